"""NCCL plumbing: the loaded library, communicators, symmetric windows, device communicators."""
