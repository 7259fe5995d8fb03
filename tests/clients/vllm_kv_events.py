"""vLLM's own KV-event code against warmpath (tests/kv_events.rs runs this).

vLLM 0.33.0's `vllm/distributed/kv_events.py` is loaded alone, from the file that
tests/tools/setup-venv.sh takes out of the published wheel: its four imports from the rest
of vLLM are replaced by the small stand-ins below (what the file uses of them, behaving as
vLLM's own do), so only msgspec and pyzmq are needed. The event types, the batch type and
the `ZmqEventPublisher` are vLLM's, unchanged.

    vllm_kv_events.py KV_EVENTS_PY decode ENDPOINT BATCHES SECONDS
        Subscribes to ENDPOINT (engine-sim's KV events) and decodes each message's batch
        with msgspec's decoder of vLLM's `KVEventBatch`, then encodes the decoded batch
        again: equal bytes mean engine-sim sent exactly what vLLM's types give (field names,
        order, omitted defaults, integer hashes). Stops after BATCHES batches or SECONDS;
        prints one JSON line.
    vllm_kv_events.py KV_EVENTS_PY decode-hex HEX
        Decodes one batch given in hex; prints {"ok": ..., "error": ...}.
    vllm_kv_events.py KV_EVENTS_PY publish ENDPOINT REPLAY SALT
        Runs vLLM's `ZmqEventPublisher` bound at ENDPOINT with its replay socket at REPLAY,
        prints the prompts' token ids as one JSON line, then publishes one batch per step
        named on stdin (see STEPS), answering "ok STEP" to each.
"""

import dataclasses
import importlib.util
import ipaddress
import json
import logging
import os
import sys
import time
import types
import urllib.parse


def load_kv_events(path):
    """vLLM's kv_events.py as module `vllm.distributed.kv_events`, its imports stubbed."""

    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        sys.modules[name] = m
        return m

    for name in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core",
                 "vllm.distributed"]:
        module(name, __path__=[])

    @dataclasses.dataclass
    class KVEventsConfig:
        # vllm/config/kv_events.py: the publisher records its resolved settings in one.
        enable_kv_cache_events: bool = False
        publisher: str = None
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

        def __post_init__(self):
            if self.publisher is None:
                self.publisher = "zmq" if self.enable_kv_cache_events else "null"

    def is_valid_ipv6_address(address):
        try:
            ipaddress.IPv6Address(address)
            return True
        except ValueError:
            return False

    def get_tcp_uri(ip, port):
        return f"tcp://[{ip}]:{port}" if is_valid_ipv6_address(ip) else f"tcp://{ip}:{port}"

    def split_zmq_path(path):
        parsed = urllib.parse.urlparse(path)
        if not parsed.scheme:
            raise ValueError(f"Invalid zmq path: {path}")
        host = parsed.hostname or ""
        port = "" if parsed.port is None else str(parsed.port)
        if parsed.scheme == "tcp" and not (host and port):
            raise ValueError(f"Invalid zmq path: {path}")
        if parsed.scheme != "tcp" and port:
            raise ValueError(f"Invalid zmq path: {path}")
        return parsed.scheme, host, port

    def get_ip():
        # vLLM: VLLM_HOST_IP, else the address of the default route; the tests are on
        # loopback.
        return os.environ.get("VLLM_HOST_IP") or "127.0.0.1"

    module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    module("vllm.logger", init_logger=logging.getLogger)
    module("vllm.utils.network_utils", get_ip=get_ip, get_tcp_uri=get_tcp_uri,
           is_valid_ipv6_address=is_valid_ipv6_address, split_zmq_path=split_zmq_path)
    module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    spec = importlib.util.spec_from_file_location("vllm.distributed.kv_events", path)
    ke = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = ke
    spec.loader.exec_module(ke)
    return ke


def decode(ke, endpoint, want, seconds):
    import msgspec
    import zmq

    decoder = msgspec.msgpack.Decoder(ke.KVEventBatch)
    encoder = msgspec.msgpack.Encoder()
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    out = {"batches": 0, "equal": 0, "events": {}, "errors": [], "first_stored": None,
           "ranks": []}
    deadline = time.time() + seconds
    while out["batches"] < want and time.time() < deadline:
        if not sub.poll(200):
            continue
        frames = sub.recv_multipart()
        if len(frames) != 3 or len(frames[1]) != 8:
            out["errors"].append(f"{len(frames)} frames")
            continue
        try:
            batch = decoder.decode(frames[2])
        except msgspec.ValidationError as e:
            out["errors"].append(str(e))
            continue
        out["batches"] += 1
        out["equal"] += encoder.encode(batch) == frames[2]
        out["ranks"].append(batch.data_parallel_rank)
        for e in batch.events:
            kind = type(e).__name__
            out["events"][kind] = out["events"].get(kind, 0) + 1
            if kind == "BlockStored" and out["first_stored"] is None:
                out["first_stored"] = {f: repr(getattr(e, f)) for f in e.__struct_fields__}
    print(json.dumps(out), flush=True)


def decode_hex(ke, text):
    import msgspec

    try:
        msgspec.msgpack.decode(bytes.fromhex(text), type=ke.KVEventBatch)
        print(json.dumps({"ok": True, "error": None}))
    except msgspec.ValidationError as e:
        print(json.dumps({"ok": False, "error": str(e)}))


B = 16  # the engine's GPU block size, and the pool's
P = list(range(1000, 1096))  # 96 tokens: 4 blocks on the GPU, CPU chunks of 48
S = list(range(3000, 3048))  # 48 tokens: vLLM 0.33's self-describing CPU chunk
Q = list(range(5000, 5600))  # 600 tokens: LMCache's chunks of 256, 256 and 88
R = list(range(9000, 9032))  # 32 tokens under LoRA adapter sql-lora
PROBE = list(range(20000, 20016))


def h(base, i):
    """An engine block hash: an integer, as vLLM publishes them by default."""
    return base + i


def steps(ke, salt):
    """Each step's events, built as the reference code builds them."""
    gpu = ke.MEDIUM_GPU

    def block_pool(tokens, base, lora=None):
        # vllm/v1/core/block_pool.py `_build_block_stored_event`: one event for a request's
        # new full blocks; extra keys per block (LoRA name first, then the salt on the first
        # block only), group 0.
        n = len(tokens) // B
        keys = [tuple(k for k in ((lora,) if lora else ()) + ((salt,) if i == 0 else ()))
                or None for i in range(n)]
        return ke.BlockStored(
            block_hashes=[h(base, i) for i in range(n)], parent_block_hash=None,
            token_ids=tokens[: n * B], block_size=B, lora_id=1 if lora else None,
            medium=gpu, lora_name=lora, extra_keys=keys, group_idx=0)

    def lmcache_chunks(tokens, base, chunk=256):
        # lmcache/v1/cache_engine.py `store` (CacheStoreEvent per chunk: block_size is the
        # chunk's length, the last one shorter, parent the previous chunk hash, medium
        # "cpu"), as lmcache_mp_connector.py hands it to vLLM's BlockStored: no extra keys.
        out, parent = [], None
        for i, start in enumerate(range(0, len(tokens), chunk)):
            part = tokens[start:start + chunk]
            out.append(ke.BlockStored(
                block_hashes=[h(base, i)], parent_block_hash=parent, token_ids=part,
                block_size=len(part), lora_id=None, medium="cpu", lora_name=None))
            parent = h(base, i)
        return out

    return {
        "probe": [block_pool(PROBE, 0xfeed00)],
        "unprobe": [ke.BlockRemoved(block_hashes=[h(0xfeed00, 0)], medium=gpu, group_idx=0)],
        # vLLM's GPU blocks: the first 64 tokens of P, the first block of S and the first
        # two of Q (the GPU chains LMCache's and the CPU offload's chunks attach to).
        "gpu": [block_pool(P[:64], 0x100), block_pool(S[:16], 0x300),
                block_pool(Q[:32], 0x500)],
        # vLLM 0.11's OffloadingConnector (offloading_connector.py `take_events`): a CPU
        # chunk of 48 tokens over 16-token GPU blocks, named by its last GPU block's hash,
        # without tokens or parent (0.11's BlockStored had no lora_name yet; 0.33's type
        # requires one, None). Then the GPU evicts blocks 1 to 3 of P
        # (block_pool.py's BlockRemoved): P's first 3 blocks are left in the CPU tier.
        "vllm_cpu_48": [ke.BlockStored(
            block_hashes=[h(0x100, 2)], parent_block_hash=None, token_ids=[], lora_id=None,
            block_size=48, medium=ke.MEDIUM_CPU, lora_name=None)],
        "evict_gpu": [ke.BlockRemoved(block_hashes=[h(0x100, i) for i in (1, 2, 3)],
                                      medium=gpu, group_idx=0)],
        # vLLM 0.33's OffloadingConnector with self-describing events
        # (offloading/events.py `_take_stored_event`): a 48-token chunk as its three
        # 16-token block hashes, with the chunk's tokens, no extra keys.
        "vllm_cpu_self_describing": [ke.BlockStored(
            block_hashes=[h(0x300, i) for i in range(3)], parent_block_hash=None,
            token_ids=S, block_size=B, lora_id=None, medium=ke.MEDIUM_CPU, lora_name=None,
            extra_keys=None, group_idx=0, kv_cache_spec_kind="full_attention")],
        "lmcache": lmcache_chunks(Q, 0x7F00000000000000),
        "lora": [block_pool(R, 0x900, lora="sql-lora")],
        # LMCache's CacheRemoveEvent of its second chunk, as BlockRemoved.
        "remove_chunk": [ke.BlockRemoved(block_hashes=[h(0x7F00000000000000, 1)],
                                         medium="cpu")],
        "clear": [ke.AllBlocksCleared()],
    }


def publish(ke, endpoint, replay, salt):
    publisher = ke.ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint,
                                     replay_endpoint=replay)
    plan = steps(ke, salt)
    print(json.dumps({"block_tokens": B, "P": P, "S": S, "Q": Q, "R": R}), flush=True)
    for line in sys.stdin:
        step = line.strip()
        if not step:
            continue
        publisher.publish(ke.KVEventBatch(ts=time.time(), events=plan[step]))
        print(f"ok {step}", flush=True)
    publisher.shutdown()


def main():
    ke = load_kv_events(sys.argv[1])
    command = sys.argv[2]
    if command == "decode":
        decode(ke, sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    elif command == "decode-hex":
        decode_hex(ke, sys.argv[3])
    elif command == "publish":
        publish(ke, sys.argv[3], sys.argv[4], sys.argv[5])
    else:
        sys.exit(f"unknown command {command}")


if __name__ == "__main__":
    main()
