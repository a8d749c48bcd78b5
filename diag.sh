set -x
which g++ gcc; g++ --version | head -1; /opt/gcc/bin/g++ --version | head -1
SO=$(python3 -c 'import qca_lowmem._C as m; print(m.__file__)')
ldd $SO | grep -i "stdc\|gcc\|torch\|c10"
python3 -c 'import torch,sys; print(sys.version); print(torch.__config__.show())' | head -30
cat > /tmp/crash.py <<'PY'
import torch, qca_lowmem, sys
which = sys.argv[1]
try:
    if which == "gn":
        torch.ops.qca_lowmem.groupnorm_elu(torch.randn(3, 4, 5), torch.ones(4), torch.zeros(4), 2, 1e-5)
    elif which == "pack":
        torch.ops.qca_lowmem.qca_pack(torch.randn(3, 4, 5), None, False)
    elif which == "gn_cuda":
        torch.ops.qca_lowmem.groupnorm_elu(torch.randn(3, 4, 5, device="cuda"), torch.ones(4, device="cuda"), torch.zeros(4, device="cuda"), 2, 1e-5)
except RuntimeError as e:
    print(which, "raised:", str(e).splitlines()[0][:150])
PY
for w in pack gn gn_cuda; do python3 /tmp/crash.py $w; echo "rc=$?"; done
timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" --args python3 /tmp/crash.py gn 2>&1 | grep -v "^\[New Thread\|^\[Thread" | head -80
