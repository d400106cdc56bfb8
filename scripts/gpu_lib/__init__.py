"""Helpers of scripts/gpu_check.sh: the GPU-only checks it runs on a lent GPU machine (the client's
device step under a CUDA graph, NVSHMEM on one GPU, timings), the import list it checks without
one, and the start-up hook that hides the packages that machine lacks."""
