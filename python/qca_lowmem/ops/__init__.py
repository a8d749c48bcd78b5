"""The op families' Python faces: typed wrappers over torch.ops.qca_lowmem.*, their fake kernels
and autograd (one module per C/CUDA family), and the helpers they share.

The lowest layer of the package: it imports only torch, the native library and `stock` (the
reference the ops' double backward runs through).
"""

from ._loader import load_native

# The one place the native library is loaded: it registers torch.ops.qca_lowmem, which the op
# modules wrap. Importing any op module runs this first.
load_native()
