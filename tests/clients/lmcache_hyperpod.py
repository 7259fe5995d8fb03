"""LMCache's own HyperPod connector against warmpath's agent (tests/hyperpod.rs runs it).

Usage: lmcache_hyperpod.py HOST:PORT SHM_NAME

Drives `SageMakerHyperPodConnector` from the published lmcache 0.5.6 package, on CPU,
against a running `warmpath agent --hyperpod-listen HOST:PORT --hyperpod-shm-name SHM_NAME`.
The connector needs a local CPU backend only for its config, metadata and allocate(); a
small stand-in gives those, with LMCache's own AdHocMemoryAllocator. Each check prints
`ok <what>`; the last line is `all checks passed`. Any failure raises.
"""

import asyncio
import json
import os
import sys
import time
import urllib.request

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector.sagemaker_hyperpod_adapter import (
    SageMakerHyperPodConnectorAdapter,
)
from lmcache.v1.storage_backend.connector.sagemaker_hyperpod_connector import (
    SageMakerHyperPodConnector,
)

ADDR, SHM = sys.argv[1], sys.argv[2]
URL = f"http://{ADDR}"
MODEL = "meta-llama/Llama-3-8B"  # a slash: the key's quoting must carry it

config = LMCacheEngineConfig.from_defaults(
    chunk_size=256, remote_url=f"sagemaker-hyperpod://{ADDR}"
)
metadata = LMCacheMetadata(
    model_name=MODEL,
    world_size=1,
    local_world_size=1,
    worker_id=0,
    local_worker_id=0,
    kv_dtype=torch.bfloat16,
    kv_shape=(2, 2, 256, 8, 64),
    chunk_size=256,
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lmcache_stand_ins import LocalCpu as _LocalCpu, check, kv_object, run_and_exit  # noqa: E402,E501


def LocalCpu():
    return _LocalCpu(config, metadata)


def health():
    with urllib.request.urlopen(f"{URL}/v1/health", timeout=5) as r:
        return json.load(r)


def key(chunk_hash):
    return CacheEngineKey(
        model_name=MODEL, world_size=1, worker_id=0, chunk_hash=chunk_hash,
        dtype=torch.bfloat16,
    )


def obj(shape, seed):
    return kv_object(shape, seed)


def connector(loop, ttl_s=10.0):
    return SageMakerHyperPodConnector(
        sagemaker_hyperpod_url=URL, loop=loop, local_cpu_backend=LocalCpu(),
        bucket_name="lmcache", shared_memory_name=SHM, max_concurrent_requests=8,
        max_connections=8, max_connections_per_host=8, timeout_ms=5000,
        lease_ttl_s=ttl_s,
    )


async def main():
    loop = asyncio.get_running_loop()
    # The adapter LMCache builds from remote_url maps sagemaker-hyperpod:// to http://.
    check(SageMakerHyperPodConnectorAdapter is not None, "adapter importable")
    c = connector(loop)
    check(c.shared_memory_map is not None and len(c.shared_memory_map) == health()["bytes"],
          "connector mapped the agent's segment")

    k1 = key(0x1234ABCD)
    check(not await c.exists(k1), "exists before put: False (a miss)")
    o1 = obj((2, 2, 256, 512), 1)  # 1 MiB of bf16
    await c.put(k1, o1)
    check(c.stats["put_success"] == 1 and c.stats["put_failure"] == 0, "put stored")
    check(await c.exists(k1), "exists after put: True")
    got = await c.get(k1)
    check(got is not None, "get found the object")
    check(got.get_shape() == o1.get_shape() and got.get_dtype() == torch.bfloat16
          and got.get_memory_format() == MemoryFormat.KV_2LTD,
          "get: shape, dtype and format from the RemoteMetadata header")
    check(torch.equal(got.tensor.view(torch.int16), o1.tensor.view(torch.int16)),
          "get: byte-equal to what was put")

    # A second put of the same key: the agent answers 409, which the connector counts
    # as a success (the key exists).
    await c.put(k1, obj((2, 2, 256, 512), 99))
    check(c.stats["put_success"] == 2 and c.stats["put_failure"] == 0,
          "second put: 409, taken as stored")
    got = await c.get(k1)
    check(torch.equal(got.tensor.view(torch.int16), o1.tensor.view(torch.int16)),
          "the first writer's bytes stay")

    check(await c.get(key(0xDEAD)) is None, "get of a key never put: None (a miss)")

    # Several objects, put and read as LMCache batches them (16 MiB in all).
    keys = [key(0x1000 + i) for i in range(4)]
    objs = [obj((2, 2, 256, 2048), 10 + i) for i in range(4)]  # 4 MiB each
    await c.batched_put(keys, objs)
    hits = await c.batched_async_contains("lookup-1", keys + [key(0xBEEF)])
    check(hits == 4, "batched contains: 4 leading hits, then the miss")
    gots = await c.batched_get(keys)
    check(all(g is not None and torch.equal(g.tensor.view(torch.int16), o.tensor.view(torch.int16))
              for g, o in zip(gots, objs)),
          "batched get: 4 x 4 MiB byte-equal")

    # Every get and exists released its lease.
    check(health()["leases"] == 0, "every lease released")
    check(c.stats["lease_released"] == c.stats["lease_acquired"]
          and c.stats["lease_release_failed"] == 0, "the connector's own count agrees")

    # A client that never releases: its lease ends at its ttl.
    short = connector(loop, ttl_s=0.3)
    lease = await short._acquire_lease(k1)
    check(lease is not None and len(lease.offsets) == 1, "lease acquired (ttl 0.3 s)")
    check(health()["leases"] == 1, "the lease is open")
    time.sleep(0.8)
    check(health()["leases"] == 0, "the lease expired without a release")
    check(not await short._release_lease(k1, lease.lease_id),
          "releasing the expired lease is refused")
    check(await c.get(k1) is not None, "the object is still there after its lease ended")

    print("all checks passed", flush=True)


run_and_exit(main)
