"""The kernels backend: the JIT-compiled kernels over the peer windows of one NVLink domain (NCCL
LSA) or of the virtual ranks of one GPU.

- `backend`: the `EPBackend` (`NvlinkBackend`).
- `runtime`: one buffer's windows, waits, device-fault decoding and launch sequences.
- `specs`: the kernel specs and the ctypes mirrors of their argument structs.
- `layout`: the window layout, the token records and the sizes built on them.
- `nccl`: the NCCL library, communicators, symmetric windows and device communicators.
"""
