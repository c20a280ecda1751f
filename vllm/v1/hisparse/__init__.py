# SPDX-License-Identifier: Apache-2.0
"""Hybrid HiSparse: residency of the sparse-MLA KV cache of DSA models."""
