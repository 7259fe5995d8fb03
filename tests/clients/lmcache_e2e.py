"""One engine's LMCache storing a prompt through warmpath's agent (tests/lmcache_e2e.rs).

Usage: lmcache_e2e.py HOST:PORT SHM_NAME KV_EVENTS_PY ENDPOINT REPLAY SALT

Runs in the lmcache 0.5.6 venv (tests/tools/setup-lmcache-venv.sh), which also has msgspec
and pyzmq. Two pieces of reference code, unchanged:
- LMCache's `SageMakerHyperPodConnector` against the agent's HyperPod API at HOST:PORT
  (segment SHM_NAME), with the chunk keys LMCache's own `ChunkedTokenDatabase` makes for
  the prompt (256-token chunks, the last one shorter);
- vLLM 0.33's `ZmqEventPublisher` (KV_EVENTS_PY loaded alone, as vllm_kv_events.py does),
  bound at ENDPOINT with its replay socket at REPLAY, publishing what a vLLM + LMCache
  engine publishes for that prompt: the GPU's first block (salted with SALT) and LMCache's
  CPU `BlockStored` per chunk (lmcache/v1/cache_engine.py's CacheStoreEvent: block_size
  the chunk's length, parent the previous chunk hash, medium "cpu", no extra keys).

Prints the prompt as one JSON line, then does each step named on stdin and answers
"ok STEP" (a failure raises):
  probe / unprobe  a throwaway GPU block and its removal (until the agent subscribed)
  store            the connector puts every chunk's KV object (before any event of it)
  events           one batch: the GPU block, then LMCache's chunk events
  drop_local       LMCache's CPU tier and the GPU drop them (BlockRemoved): only the
                   agent's segment holds the prompt now
  get              the connector gets every chunk back; byte-equal to what was put
"""

import asyncio
import json
import os
import sys
import time

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.sagemaker_hyperpod_connector import (
    SageMakerHyperPodConnector,
)
from lmcache.v1.token_database import ChunkedTokenDatabase

ADDR, SHM, KV_EVENTS_PY, ENDPOINT, REPLAY, SALT = sys.argv[1:7]
MODEL = "sim-llama"
CHUNK = 256
B = 16  # the engine's GPU block size, and the pool's
PROMPT = list(range(5000, 5600))  # 600 tokens: chunks of 256, 256 and 88

config = LMCacheEngineConfig.from_defaults(
    chunk_size=CHUNK, remote_url=f"sagemaker-hyperpod://{ADDR}"
)
metadata = LMCacheMetadata(
    model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
    kv_dtype=torch.bfloat16, kv_shape=(2, 2, CHUNK, 8, 64), chunk_size=CHUNK,
)
allocator = AdHocMemoryAllocator("cpu")
# LMCache's own chunk keys for the prompt, made before vLLM's stand-ins are loaded (so
# LMCache takes its builtin hash, as it does where vLLM's hashing is not importable).
CHUNKS = [(s, e, k) for s, e, k in ChunkedTokenDatabase(config, metadata).process_tokens(
    tokens=PROMPT)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_kv_events  # noqa: E402

ke = vllm_kv_events.load_kv_events(KV_EVENTS_PY)


class LocalCpu:
    """What the connector reads of LMCache's LocalCPUBackend: config, metadata, allocate."""

    def __init__(self):
        self.config = config
        self.metadata = metadata

    def allocate(self, shape, dtype, fmt=MemoryFormat.KV_2LTD, **_):
        return allocator.allocate(shape, dtype, fmt)


def obj(tokens, seed):
    o = allocator.allocate(torch.Size((2, 2, tokens, 512)), torch.bfloat16,
                           MemoryFormat.KV_2LTD)
    g = torch.Generator().manual_seed(seed)
    o.tensor.copy_(torch.randn(o.tensor.shape, generator=g).to(torch.bfloat16))
    return o


PROBE = list(range(20000, 20016))
GPU_HASH, PROBE_HASH = 0x5000, 0xFEED00


def gpu_block(tokens, h, salt):
    # vllm/v1/core/block_pool.py's BlockStored for a request's first full block.
    return ke.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=tokens,
                          block_size=B, lora_id=None, medium=ke.MEDIUM_GPU,
                          lora_name=None, extra_keys=[(salt,)], group_idx=0)


def chunk_events():
    out, parent = [], None
    for start, end, key in CHUNKS:
        out.append(ke.BlockStored(
            block_hashes=[key.chunk_hash], parent_block_hash=parent,
            token_ids=PROMPT[start:end], block_size=end - start, lora_id=None,
            medium="cpu", lora_name=None))
        parent = key.chunk_hash
    return out


async def main():
    loop = asyncio.get_running_loop()
    c = SageMakerHyperPodConnector(
        sagemaker_hyperpod_url=f"http://{ADDR}", loop=loop, local_cpu_backend=LocalCpu(),
        bucket_name="lmcache", shared_memory_name=SHM, max_concurrent_requests=8,
        max_connections=8, max_connections_per_host=8, timeout_ms=5000)
    publisher = ke.ZmqEventPublisher(data_parallel_rank=0, endpoint=ENDPOINT,
                                     replay_endpoint=REPLAY)
    objs = {}
    print(json.dumps({
        "prompt": PROMPT,
        "chunks": [[s, e, k.to_string()] for s, e, k in CHUNKS],
    }), flush=True)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break
        step = line.decode().strip()
        if step == "probe":
            batch = [gpu_block(PROBE, PROBE_HASH, SALT)]
        elif step == "unprobe":
            batch = [ke.BlockRemoved(block_hashes=[PROBE_HASH], medium=ke.MEDIUM_GPU,
                                     group_idx=0)]
        elif step == "store":
            for i, (s, e, k) in enumerate(CHUNKS):
                objs[k.chunk_hash] = obj(e - s, 100 + i)
                await c.put(k, objs[k.chunk_hash])
            if c.stats["put_failure"] != 0 or c.stats["put_success"] != len(CHUNKS):
                raise AssertionError(f"puts failed: {c.stats}")
            batch = None
        elif step == "events":
            batch = [gpu_block(PROMPT[:B], GPU_HASH, SALT)] + chunk_events()
        elif step == "drop_local":
            batch = [ke.BlockRemoved(block_hashes=[GPU_HASH], medium=ke.MEDIUM_GPU,
                                     group_idx=0),
                     ke.BlockRemoved(block_hashes=[k.chunk_hash for _, _, k in CHUNKS],
                                     medium="cpu")]
        elif step == "get":
            total = 0
            for s, e, k in CHUNKS:
                got = await c.get(k)
                want = objs[k.chunk_hash]
                if got is None:
                    raise AssertionError(f"chunk {s}..{e}: a miss")
                if not torch.equal(got.tensor.view(torch.int16), want.tensor.view(torch.int16)):
                    raise AssertionError(f"chunk {s}..{e}: other bytes")
                total += got.tensor.numel() * 2
            print(f"got {len(CHUNKS)} chunks, {total} bytes, byte-equal", flush=True)
            batch = None
        else:
            raise AssertionError(f"unknown step {step}")
        if batch is not None:
            publisher.publish(ke.KVEventBatch(ts=time.time(), events=batch))
        print(f"ok {step}", flush=True)
    publisher.shutdown()


try:
    asyncio.run(main())
except BaseException:
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
# The connector's close() blocks (lmcache 0.5.6): leave without it.
sys.stdout.flush()
os._exit(0)
