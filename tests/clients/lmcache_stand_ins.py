"""What the LMCache-driving test scripts share (lmcache_hyperpod.py, lmcache_lm.py,
lmcache_e2e.py): the part of LMCache's LocalCPUBackend its remote connectors use, a KV
object with seeded contents, the check that prints what passed, and how a script ends.

Runs in the lmcache 0.5.6 venv (tests/tools/setup-lmcache-venv.sh).
"""

import asyncio
import os
import sys
import traceback

import torch

from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

ALLOCATOR = AdHocMemoryAllocator("cpu")


class LocalCpu:
    """What a remote connector reads of LMCache's LocalCPUBackend: config, metadata and
    allocate (with LMCache's own AdHocMemoryAllocator)."""

    def __init__(self, config, metadata):
        self.config = config
        self.metadata = metadata

    def allocate(self, shape, dtype, fmt=MemoryFormat.KV_2LTD, **_):
        return ALLOCATOR.allocate(shape, dtype, fmt)


def kv_object(shape, seed):
    """A bfloat16 KV_2LTD memory object of `shape`, its contents drawn from `seed`."""
    o = ALLOCATOR.allocate(torch.Size(shape), torch.bfloat16, MemoryFormat.KV_2LTD)
    g = torch.Generator().manual_seed(seed)
    o.tensor.copy_(torch.randn(o.tensor.shape, generator=g).to(torch.bfloat16))
    return o


def check(cond, what):
    if not cond:
        raise AssertionError(what)
    print("ok", what, flush=True)


def run_and_exit(main):
    """Runs the coroutine function `main`, then leaves at once: 1 with the traceback when it
    raised, else 0. Without closing the connectors: their close() blocks (lmcache 0.5.6)."""
    try:
        asyncio.run(main())
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)
