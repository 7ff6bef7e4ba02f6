"""The kernels backend: the JIT-compiled kernels over the peer windows of one NVLink domain (NCCL
LSA) or of the virtual ranks of one GPU.

- `backend`: the `EPBackend` (`NvlinkBackend`).
- `transport`: which peer windows a group uses, and why; the part of the GPU a rank may use.
- `runtime`: one buffer's resources, host waits and device-fault decoding.
- `dispatch`, `combine`: the launch sequences of one dispatch and one combine.
- `specs`: the kernel specs and the ctypes mirrors of their argument structs.
- `layout`: the window layout, the token records and the sizes built on them.
- `nccl`: the NCCL library, communicators, symmetric windows and device communicators.
"""
