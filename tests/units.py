"""Byte units for the tests (binary, as PyTorch's allocator and its snapshots count): one
definition, imported by name (`from units import KiB, MiB, GiB`)."""
KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
