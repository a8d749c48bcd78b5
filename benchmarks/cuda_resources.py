"""What each CUDA kernel costs the GPU, from ptxas (no GPU needed): registers, spills, static
shared memory and stack per kernel and architecture, and the occupancy they allow at the
kernel's block size (its __launch_bounds__). Writes benchmarks/results/cuda_resources.json.

    python benchmarks/cuda_resources.py [--out PATH] [--jobs N]
"""

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "csrc" / "kernels"
ARCHS = ["sm_75", "sm_80", "sm_86", "sm_89", "sm_90"]

# Per multiprocessor (CUDA C Programming Guide, compute capabilities table): threads, resident
# blocks, shared memory available to blocks and what each block reserves. Every one of these has
# 64 Ki 32-bit registers in four partitions, allocated per warp in units of 256.
SM_LIMITS = {
    "sm_75": {"threads": 1024, "blocks": 16, "shared": 64 * 1024, "reserved": 0},
    "sm_80": {"threads": 2048, "blocks": 32, "shared": 164 * 1024, "reserved": 1024},
    "sm_86": {"threads": 1536, "blocks": 16, "shared": 100 * 1024, "reserved": 1024},
    "sm_89": {"threads": 1536, "blocks": 24, "shared": 100 * 1024, "reserved": 1024},
    "sm_90": {"threads": 2048, "blocks": 32, "shared": 228 * 1024, "reserved": 1024},
}


def nvcc():
    home = os.environ.get("CUDA_HOME") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else shutil.which("nvcc")


def blocks_per_sm(arch, threads, registers, shared_bytes=0):
    """Resident blocks of `threads` threads for a kernel of `registers` registers per thread."""
    limits = SM_LIMITS[arch]
    warps = -(-threads // 32)
    registers_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_registers = 4 * (16384 // registers_per_warp) // warps  # warps fit per partition
    by_threads = limits["threads"] // (warps * 32)
    by_shared = limits["shared"] // (shared_bytes + limits["reserved"]) if shared_bytes else limits["blocks"]
    return min(by_registers, by_threads, by_shared, limits["blocks"])


def occupancy(arch, threads, registers, shared_bytes=0):
    """Resident warps over the most the multiprocessor holds."""
    warps = -(-threads // 32)
    return blocks_per_sm(arch, threads, registers, shared_bytes) * warps * 32 / SM_LIMITS[arch]["threads"]


def readable(mangled_names):
    """Demangled kernel names, without nvcc's per-file namespaces (their hashes change with the
    file) or parameter lists."""
    out = subprocess.run(["c++filt"], input="\n".join(mangled_names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    names = []
    for name in out:
        name = re.sub(r"_INTERNAL_\w+?_cu_\w+?::|\(anonymous namespace\)::", "", name)
        depth, end = 0, len(name)
        for i, c in enumerate(name):  # the parameter list: the last top-level "(...)"
            depth += c in "<"
            depth -= c in ">"
            if c == "(" and depth == 0:
                end = i
        names.append(name[:end].removeprefix("void "))
    return names


def block_sizes(source):
    """{mangled kernel: threads per block} from the .maxntid that __launch_bounds__ puts in PTX."""
    result = subprocess.run([nvcc(), "-ptx", "-arch=compute_90", "-I", str(ROOT / "include"),
                             str(source), "-o", "-"], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc -ptx {source.name} failed:\n{result.stderr}")
    sizes = {}
    for entry, body in re.findall(r"\.entry\s+(\w+)\((.*?)\{", result.stdout, re.S):
        found = re.search(r"\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)", body)
        sizes[entry] = int(found[1]) * int(found[2]) * int(found[3]) if found else None
    return sizes


def ptxas_report(source, archs):
    """[(mangled kernel, arch, registers, spill stores, spill loads, shared, stack)]."""
    gencode = [f"-gencode=arch=compute_{a[3:]},code={a}" for a in archs]
    result = subprocess.run([nvcc(), "-c", "-O3", "-Xptxas", "-v", *gencode, "-I", str(ROOT / "include"),
                             str(source), "-o", os.devnull], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc {source.name} failed:\n{result.stderr}")
    rows = []
    pattern = (r"Compiling entry function '(\w+)' for '(sm_\d+)'.*?"
               r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?"
               r"Used (\d+) registers([^\n]*)")
    for name, arch, stack, stores, loads, registers, rest in re.findall(pattern, result.stderr, re.S):
        shared = re.search(r"(\d+) bytes smem", rest)
        rows.append((name, arch, int(registers), int(stores), int(loads),
                     int(shared[1]) if shared else 0, int(stack)))
    return rows


def collect(archs=ARCHS, sources=None, jobs=2):
    """One record per kernel and architecture, in the JSON's format."""
    sources = sorted(sources or KERNELS.glob("*.cu"))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        reports = list(pool.map(lambda s: ptxas_report(s, archs), sources))
        sizes = list(pool.map(block_sizes, sources))
    records = []
    for source, rows, threads_of in zip(sources, reports, sizes):
        names = readable([r[0] for r in rows])
        for (mangled, arch, registers, stores, loads, shared, stack), name in zip(rows, names):
            threads = threads_of.get(mangled)
            records.append({
                "kernel": name, "file": source.name, "arch": arch, "registers": registers,
                "spill_stores": stores, "spill_loads": loads, "shared_bytes": shared,
                "stack_bytes": stack, "threads": threads,
                "occupancy": round(occupancy(arch, threads, registers, shared), 4) if threads else None,
            })
    return sorted(records, key=lambda r: (r["file"], r["kernel"], r["arch"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "cuda_resources.json")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    if nvcc() is None:
        sys.exit("cuda_resources: nvcc not found (set CUDA_HOME)")
    version = subprocess.run([nvcc(), "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    commit = os.environ.get("QCA_LOWMEM_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip() or None
    report = {"kind": "ptxas", "nvcc": version, "commit": commit,
              "date": datetime.date.today().isoformat(), "kernels": collect(jobs=args.jobs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    spills = [r for r in report["kernels"] if r["spill_stores"] or r["spill_loads"]]
    print(f"{len(report['kernels'])} kernel builds, {len(spills)} with spills -> {args.out}")


if __name__ == "__main__":
    main()
