"""Kernels behind the layers: prefix + segment attention, gated delta rule, DSA sparse attention (torch paths)."""
