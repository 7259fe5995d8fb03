"""LMCache's own lm:// connector against warmpath's agent (tests/hyperpod.rs runs it).

Usage: lmcache_lm.py LM_HOST:PORT HYPERPOD_HOST:PORT SHM_NAME

Drives `LMCServerConnector` from the published lmcache 0.5.6 package, on CPU, against a
running `warmpath agent --hyperpod-listen HYPERPOD_HOST:PORT --hyperpod-shm-name SHM_NAME
--lm-listen LM_HOST:PORT`, and LMCache's `SageMakerHyperPodConnector` against the same
agent to show that the two fronts share one store. The commands the connector never sends
(health, list) are sent with LMCache's own `ClientMetaMessage` and read with its
`ServerMetaMessage`. Each check prints `ok <what>`; the last line is `all checks passed`.
Any failure raises.
"""

import asyncio
import os
import socket
import sys

import torch

from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.protocol import (
    ClientCommand,
    ClientMetaMessage,
    ServerMetaMessage,
    ServerReturnCode,
)
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector
from lmcache.v1.storage_backend.connector.sagemaker_hyperpod_connector import (
    SageMakerHyperPodConnector,
)

LM, HP, SHM = sys.argv[1], sys.argv[2], sys.argv[3]
MODEL = "meta-llama/Llama-3-8B"
CHUNK = 256

config = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, remote_url=f"lm://{LM}")
metadata = LMCacheMetadata(
    model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
    kv_dtype=torch.bfloat16, kv_shape=(2, 2, CHUNK, 8, 64), chunk_size=CHUNK,
)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lmcache_stand_ins import LocalCpu as _LocalCpu, check, kv_object, run_and_exit  # noqa: E402,E501


def LocalCpu():
    return _LocalCpu(config, metadata)


def key(chunk_hash):
    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0,
                          chunk_hash=chunk_hash, dtype=torch.bfloat16)


def obj(tokens, seed):
    return kv_object((2, 2, tokens, 512), seed)


def same(a, b):
    return (a is not None and a.tensor.shape == b.tensor.shape
            and a.tensor.dtype == b.tensor.dtype
            and torch.equal(a.tensor.view(torch.int16), b.tensor.view(torch.int16)))


def raw(command):
    """One command the connector never sends, with LMCache's own message classes."""
    host, port = LM.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(ClientMetaMessage(command, key(0x77), 0, MemoryFormat(1), torch.float16,
                                    torch.Size([0, 0, 0, 0])).serialize())
        data = b""
        while len(data) < ServerMetaMessage.packlength():
            piece = s.recv(ServerMetaMessage.packlength() - len(data))
            if not piece:
                raise AssertionError(f"{command}: the agent closed without a reply")
            data += piece
        return ServerMetaMessage.deserialize(data)


async def main():
    loop = asyncio.get_running_loop()
    host, port = LM.rsplit(":", 1)
    c = LMCServerConnector(host, int(port), loop, LocalCpu())

    check(not await c.exists(key(1)), "exists before any put: False")
    check(await c.get(key(1)) is None, "get of a key never put: None")
    first = obj(CHUNK, 1)
    await c.put(key(1), first)
    check(await c.exists(key(1)), "exists after the put: True")
    check(same(await c.get(key(1)), first), "get is byte-equal, shape and dtype kept")

    # A second writer of the same key with other bytes: the first writer's bytes stay.
    await c.put(key(1), obj(CHUNK, 2))
    check(same(await c.get(key(1)), first), "a second put of a key keeps the first bytes")

    # Chunks of other lengths (a prompt's last chunk is shorter).
    objs = {h: obj(t, h) for h, t in [(2, 256), (3, 256), (4, 88), (5, 1)]}
    for h, o in objs.items():
        await c.put(key(h), o)
    for h, o in objs.items():
        check(same(await c.get(key(h)), o), f"chunk {h} of {o.tensor.shape[2]} tokens")

    check(raw(ClientCommand.HEALTH).code == ServerReturnCode.SUCCESS, "health: 200")
    check(raw(ClientCommand.LIST).code == ServerReturnCode.FAIL, "list: refused (400)")

    # The other front: LMCache's HyperPod connector reads what lm:// stored, and lm://
    # reads what it stored.
    hp = SageMakerHyperPodConnector(
        sagemaker_hyperpod_url=f"http://{HP}", loop=loop, local_cpu_backend=LocalCpu(),
        bucket_name="lmcache", shared_memory_name=SHM, max_concurrent_requests=4,
        max_connections=4, max_connections_per_host=4, timeout_ms=5000)
    check(same(await hp.get(key(1)), first), "the HyperPod connector reads an lm:// object")
    via_hp = obj(CHUNK, 6)
    await hp.put(key(6), via_hp)
    check(same(await c.get(key(6)), via_hp), "lm:// reads a HyperPod object")
    print("all checks passed", flush=True)


run_and_exit(main)
