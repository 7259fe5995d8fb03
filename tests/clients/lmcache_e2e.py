"""One engine's LMCache storing a prompt through warmpath's agent (tests/lmcache_e2e.rs).

Usage: lmcache_e2e.py HOST:PORT SHM_NAME KV_EVENTS_PY ENDPOINT REPLAY SALT MODE

Runs in the lmcache 0.5.6 venv (tests/tools/setup-lmcache-venv.sh), which also has msgspec
and pyzmq. Reference code, unchanged:
- LMCache's `SageMakerHyperPodConnector` against the agent's HyperPod API at HOST:PORT
  (segment SHM_NAME), with the chunk keys LMCache's own `ChunkedTokenDatabase` makes for
  the prompt (256-token chunks; a partial last chunk is not saved, LMCache's default);
- vLLM 0.33's `ZmqEventPublisher` (KV_EVENTS_PY loaded alone, as vllm_kv_events.py does),
  bound at ENDPOINT with its replay socket at REPLAY, publishing what a vLLM + LMCache
  engine publishes for that prompt: the GPU's first block (salted with SALT; vLLM's block
  pool is not run: the event is built in its shape) and LMCache's CPU chunks.

MODE says where LMCache's chunk events come from:
- `hand`: built here in the shape of lmcache.utils.CacheStoreEvent (block_size the chunk's
  length, its own tokens, parent the previous chunk hash, medium "cpu"), the connector
  putting the chunks' objects itself.
- `engine`: LMCache's own engine makes them. `LMCacheEngine.store` (lmcache 0.5.6, built
  by `LMCacheEngineBuilder` with `enable_kv_events`, its LocalCPUBackend and its
  RemoteBackend on the connector above) stores the prompt as lmcache's vLLM adapter
  (integration/vllm/vllm_v1_adapter.py `wait_for_save`) calls it at the end of the prefill:
  the tokens cut to whole chunks, a mask of ones. Its `get_kv_events()` go through vLLM
  0.33's own conversion (vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py
  beside KV_EVENTS_PY, loaded alone: `get_kv_connector_kv_cache_events` on the worker,
  `update_connector_output` and `take_events` on the scheduler) into the batch published
  after the GPU's events, as vLLM's scheduler does. The one stand-in is the GPU connector
  (`PagedKv`): lmcache's VLLMPagedMemGPUConnectorV2 needs CUDA (its constructor makes
  `torch.cuda.Stream`s, its kernels are lmcache.cuda_ops), so a CPU tensor is the paged
  KV buffer it copies from and to, slot by slot.

Prints the prompt as one JSON line, then does each step named on stdin and answers
"ok STEP" (a failure raises):
  probe / unprobe  a throwaway GPU block and its removal (until the agent subscribed)
  store            the chunks' KV objects are put in the agent (before any event of them)
  events           one batch: the GPU block, then LMCache's chunk events; in `engine` mode
                   first a line "events JSON" with each published chunk event's fields
  drop_local       the GPU drops its block (BlockRemoved) and LMCache's CPU tier its
                   chunks (`hand`: a BlockRemoved "cpu"; `engine`: `LMCacheEngine.clear` of
                   the LocalCPUBackend, which publishes nothing in lmcache 0.5.6): only the
                   agent's segment holds the prompt's KV now
  get              every chunk back from the agent (`engine`: `LMCacheEngine.retrieve`
                   into a zeroed buffer); byte-equal to what was stored
"""

import asyncio
import importlib.util
import json
import os
import sys
import time
import types

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.cache_engine import LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.sagemaker_hyperpod_connector import (
    SageMakerHyperPodConnector,
)
from lmcache.v1.token_database import ChunkedTokenDatabase

ADDR, SHM, KV_EVENTS_PY, ENDPOINT, REPLAY, SALT, MODE = sys.argv[1:8]
assert MODE in ("hand", "engine"), MODE
MODEL = "sim-llama"
CHUNK = 256
B = 16  # the engine's GPU block size, and the pool's
PROMPT = list(range(5000, 5600))  # 600 tokens: chunks of 256, 256 (and 88, not saved)
LAYERS, HIDDEN = 2, 8 * 64
# What vllm_v1_adapter.py's ReqMeta.from_request_tracker saves at the last prefill step
# with LMCache's default save_unfull_chunk=False: the prompt cut to whole chunks.
SAVE = PROMPT[: len(PROMPT) // CHUNK * CHUNK]

config = LMCacheEngineConfig.from_defaults(
    chunk_size=CHUNK, remote_url=f"sagemaker-hyperpod://{ADDR}",
    enable_kv_events=MODE == "engine", max_local_cpu_size=0.05,
    extra_config={"sagemaker_hyperpod_shared_memory_name": SHM},
)
metadata = LMCacheMetadata(
    model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
    kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, 8, 64), chunk_size=CHUNK,
)


class PagedKv(GPUConnectorInterface):
    """The GPU connector's stand-in: a CPU tensor [2, layers, slots, hidden] is the paged
    KV buffer (`kvcaches`), copied to and from LMCache's objects through `slot_mapping`, as
    VLLMPagedMemGPUConnectorV2 does on a GPU."""

    def from_gpu(self, memory_obj, start, end, **kwargs):
        slots = kwargs["slot_mapping"][start:end]
        memory_obj.tensor.copy_(kwargs["kvcaches"][:, :, slots, :])

    def to_gpu(self, memory_obj, start, end, **kwargs):
        slots = kwargs["slot_mapping"][start:end]
        kwargs["kvcaches"][:, :, slots, :] = memory_obj.tensor

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        for m, start, end in zip(memory_objs, starts, ends):
            self.from_gpu(m, start, end, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
        for m, start, end in zip(memory_objs, starts, ends):
            self.to_gpu(m, start, end, **kwargs)

    def get_shape(self, num_tokens):
        return torch.Size([2, LAYERS, num_tokens, HIDDEN])


# LMCache's own engine and chunk keys for the prompt, made before vLLM's stand-ins are
# loaded (so LMCache takes its builtin hash, as it does where vLLM's hashing is not
# importable).
if MODE == "engine":
    ENGINE = LMCacheEngineBuilder.get_or_create(
        f"e2e-{os.getpid()}", config, metadata, PagedKv(), None, None)
    ENGINE.post_init()
    DATABASE = ENGINE.token_database
else:
    ENGINE, DATABASE = None, ChunkedTokenDatabase(config, metadata)
CHUNKS = [(s, e, k) for s, e, k in DATABASE.process_tokens(tokens=SAVE)]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_kv_events  # noqa: E402

ke = vllm_kv_events.load_kv_events(KV_EVENTS_PY)


def load_lmcache_connector(path):
    """vLLM 0.33's lmcache_connector.py (beside kv_events.py) as its module, its imports
    from the rest of vLLM stubbed: the names it uses only as a base class or in
    annotations."""

    def module(name, **attrs):
        m = sys.modules.get(name) or types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    class Stub:
        pass

    for name in ["vllm.distributed.kv_transfer", "vllm.distributed.kv_transfer.kv_connector",
                 "vllm.distributed.kv_transfer.kv_connector.v1", "vllm.v1.attention",
                 "vllm.v1.core.sched"]:
        module(name, __path__=[])
    module("vllm.config", VllmConfig=Stub)
    module("vllm.distributed.kv_transfer.kv_connector.v1.base",
           KVConnectorBase_V1=Stub, KVConnectorMetadata=Stub, KVConnectorRole=Stub)
    module("vllm.v1.attention.backend", AttentionMetadata=Stub)
    module("vllm.v1.core.sched.output", SchedulerOutput=Stub)
    module("vllm.v1.outputs", KVConnectorOutput=Stub)
    name = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector"
    spec = importlib.util.spec_from_file_location(name, path)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m
    spec.loader.exec_module(m)
    return m


if MODE == "engine":
    lc = load_lmcache_connector(
        os.path.join(os.path.dirname(KV_EVENTS_PY), "lmcache_connector.py"))
    # vLLM's connector object, built without its __init__ (which starts LMCache through
    # vLLM's config): its engine is LMCache's, whose get_kv_events() is what lmcache's
    # LMCacheConnectorV1Impl.get_kv_events returns.
    CONNECTOR = object.__new__(lc.LMCacheConnectorV1)
    CONNECTOR._lmcache_engine = ENGINE
    CONNECTOR._kv_cache_events = None
    # The paged KV buffer the prompt's KV is stored from (random bytes, its tokens in
    # slots 0..len(SAVE)), and the slot of each token.
    PAGED = torch.randn((2, LAYERS, 2 * len(SAVE), HIDDEN),
                        generator=torch.Generator().manual_seed(100)).to(torch.bfloat16)
    SLOTS = torch.arange(len(SAVE))


def lmcache_events():
    """LMCache's events of the step, through vLLM's own code: the worker's
    get_kv_connector_kv_cache_events, then the scheduler's update_connector_output (the
    KVConnectorOutput it receives) and take_events."""
    worker = CONNECTOR.get_kv_connector_kv_cache_events()
    if worker is None:
        return []
    CONNECTOR.update_connector_output(types.SimpleNamespace(kv_cache_events=worker))
    return list(CONNECTOR.take_events())


def described(events):
    """What the test checks of each published chunk event."""
    hashes = [e.block_hashes[0] for e in events]
    return [{
        "type": type(e).__name__,
        "hashes": len(e.block_hashes),
        "parent": (None if e.parent_block_hash is None
                   else hashes.index(e.parent_block_hash)
                   if e.parent_block_hash in hashes else repr(e.parent_block_hash)),
        "block_size": e.block_size,
        "tokens": len(e.token_ids),
        "first": e.token_ids[0] if e.token_ids else None,
        "last": e.token_ids[-1] if e.token_ids else None,
        "medium": e.medium,
        "extra_keys": e.extra_keys,
        "lora_name": e.lora_name,
        "lora_id": e.lora_id,
        "group_idx": e.group_idx,
    } for e in events]


from lmcache_stand_ins import LocalCpu as _LocalCpu, kv_object, run_and_exit  # noqa: E402


def LocalCpu():
    return _LocalCpu(config, metadata)


def obj(tokens, seed):
    return kv_object((2, 2, tokens, 512), seed)


PROBE = list(range(20000, 20016))
GPU_HASH, PROBE_HASH = 0x5000, 0xFEED00


def gpu_block(tokens, h, salt):
    # vllm/v1/core/block_pool.py's BlockStored for a request's first full block.
    return ke.BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=tokens,
                          block_size=B, lora_id=None, medium=ke.MEDIUM_GPU,
                          lora_name=None, extra_keys=[(salt,)], group_idx=0)


def chunk_events():
    # `hand` mode's chunk events: each chunk's own tokens. LMCache 0.5.6's own carry one
    # token more (`convert_tokens_to_list` slices start..end+1) but the last of a store
    # call's: `engine` mode publishes those.
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
    # `engine` mode: LMCache's RemoteBackend makes its own connector.
    c = SageMakerHyperPodConnector(
        sagemaker_hyperpod_url=f"http://{ADDR}", loop=loop, local_cpu_backend=LocalCpu(),
        bucket_name="lmcache", shared_memory_name=SHM, max_concurrent_requests=8,
        max_connections=8, max_connections_per_host=8, timeout_ms=5000,
    ) if MODE == "hand" else None
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
        elif step == "store" and MODE == "engine":
            # LMCache's engine puts to its CPU tier and, asynchronously, to the agent;
            # wait until the agent holds every chunk.
            ENGINE.store(SAVE, mask=torch.ones(len(SAVE), dtype=torch.bool),
                         kvcaches=PAGED, slot_mapping=SLOTS, offset=0, req_id="req-0")
            deadline = time.time() + 20
            while not all(ENGINE.storage_manager.contains(k, ["RemoteBackend"])
                          for _, _, k in CHUNKS):
                if time.time() > deadline:
                    raise AssertionError("LMCache's puts never reached the agent")
                await asyncio.sleep(0.05)
            batch = None
        elif step == "store":
            for i, (s, e, k) in enumerate(CHUNKS):
                objs[k.chunk_hash] = obj(e - s, 100 + i)
                await c.put(k, objs[k.chunk_hash])
            if c.stats["put_failure"] != 0 or c.stats["put_success"] != len(CHUNKS):
                raise AssertionError(f"puts failed: {c.stats}")
            batch = None
        elif step == "events" and MODE == "engine":
            chunks = lmcache_events()
            print("events " + json.dumps(described(chunks)), flush=True)
            batch = [gpu_block(PROMPT[:B], GPU_HASH, SALT)] + chunks
        elif step == "events":
            batch = [gpu_block(PROMPT[:B], GPU_HASH, SALT)] + chunk_events()
        elif step == "drop_local" and MODE == "engine":
            ENGINE.clear(locations=["LocalCPUBackend"])
            if any(ENGINE.storage_manager.contains(k, ["LocalCPUBackend"])
                   for _, _, k in CHUNKS):
                raise AssertionError("LMCache's CPU tier still holds a chunk")
            chunks = lmcache_events()
            if chunks:
                raise AssertionError(f"LMCache published its CPU clear: {chunks}")
            batch = [ke.BlockRemoved(block_hashes=[GPU_HASH], medium=ke.MEDIUM_GPU,
                                     group_idx=0)]
        elif step == "drop_local":
            batch = [ke.BlockRemoved(block_hashes=[GPU_HASH], medium=ke.MEDIUM_GPU,
                                     group_idx=0),
                     ke.BlockRemoved(block_hashes=[k.chunk_hash for _, _, k in CHUNKS],
                                     medium="cpu")]
        elif step == "get" and MODE == "engine":
            out = torch.zeros_like(PAGED)
            got = ENGINE.retrieve(SAVE, mask=torch.ones(len(SAVE), dtype=torch.bool),
                                  kvcaches=out, slot_mapping=SLOTS, req_id="req-1")
            if int(got.sum()) != len(SAVE):
                raise AssertionError(f"retrieved {int(got.sum())} of {len(SAVE)} tokens")
            n = len(SAVE)
            if not torch.equal(out[:, :, :n].view(torch.int16),
                               PAGED[:, :, :n].view(torch.int16)):
                raise AssertionError("other bytes")
            print(f"got {len(CHUNKS)} chunks, {out[:, :, :n].numel() * 2} bytes, "
                  "byte-equal", flush=True)
            batch = None
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


run_and_exit(main)
