#!/bin/sh
# Creates the Python environment in which LMCache's own client code drives the agent
# (tests/hyperpod.rs runs tests/clients/lmcache_hyperpod.py with it): a venv at $1
# (tests/run passes target/lmcache-venv) holding the published lmcache 0.5.6 and the torch
# it was built against, 2.13.0, every other package pinned below (what that install
# resolved to on 2026-12-02), so a new release elsewhere cannot change what the test means.
#
# PyPI's torch is the CUDA build (download.pytorch.org's CPU-only index is not reachable
# from every CI machine); it runs on CPU, and nothing the test uses needs a GPU. Measured
# on a 2-core machine: 2 min 53 s and 5.6 GB on a fresh machine; a second run returns at
# once (the stamp is this file: edit it, and the venv is brought up to date).
# WARMPATH_SKIP_LMCACHE=1 skips it (the test then says it did not run, and why).
set -eu
venv=$1
here=$(cd "$(dirname "$0")" && pwd)
stamp="$venv/.lmcache-setup"
[ "${WARMPATH_SKIP_LMCACHE:-}" = 1 ] && exit 0
if [ -x "$venv/bin/python" ] && cmp -s "$here/setup-lmcache-venv.sh" "$stamp"; then
  exit 0
fi
python3 -m venv "$venv"
cat > "$venv/.constraints" <<'PINS'
aiofile==3.12.3
aiofiles==25.1.0
aiohappyeyeballs==2.7.1
aiohttp==3.14.5
aiosignal==1.4.0
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
attrs==26.1.0
awscrt==0.38.1
blake3==1.0.11
cachetools==8.0.2
caio==0.12.10
certifi==2026.10.19.post1
cffi==2.1.1
charset-normalizer==3.5.3
click==8.5.1
cryptography==50.0.2
cuda-bindings==13.4.4
cuda-core==1.2.2
cuda-pathfinder==1.9.1
cuda-python==13.4.4
cuda-toolkit==13.0.3.0
cufile-python==0.2.0
cupy-cuda13x==14.2.0
fastapi==0.141.1
filelock==4.3.1
frozenlist==1.8.0
fsspec==2026.9.0
google-api-core==2.34.0
google-auth==2.63.0
google-cloud-bigtable==2.50.2
google-cloud-core==2.8.0
google-cloud-monitoring==2.32.0
google-crc32c==1.9.0
googleapis-common-protos==1.76.0
grpc-google-iam-v1==0.14.6
grpcio-observability==1.78.0
grpcio-status==1.78.0
grpcio==1.78.0
h11==0.16.0
hf-xet==1.8.0
httpcore2==2.16.2
httpcore==1.0.9
httptools==0.9.0
httpx2==2.16.2
httpx==0.28.1
huggingface_hub==2.4.0
idna==3.20
importlib_metadata==8.7.1
iniconfig==2.3.1
Jinja2==3.1.6
llvmlite==0.50.0
lmcache==0.5.6
markdown-it-py==4.3.0
MarkupSafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
msgspec==0.23.0
multidict==7.2.1
networkx==3.6.1
numba==0.68.1
numpy==2.2.6
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.20.0.48
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.29.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
nvtx==0.2.17
opentelemetry-api==1.40.0
opentelemetry-exporter-otlp-proto-common==1.40.0
opentelemetry-exporter-otlp-proto-grpc==1.40.0
opentelemetry-exporter-otlp-proto-http==1.40.0
opentelemetry-exporter-otlp==1.40.0
opentelemetry-exporter-prometheus==0.61b0
opentelemetry-proto==1.40.0
opentelemetry-sdk==1.40.0
opentelemetry-semantic-conventions==0.61b0
packaging==26.4
pluggy==1.7.0
prometheus_client==0.24.1
propcache==0.5.4
proto-plus==1.29.0
protobuf==6.33.6
psutil==7.2.2
py-cpuinfo==9.0.0
pyasn1==0.6.5
pyasn1_modules==0.4.2
pycparser==3.12
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
pytest==9.2.0
PyYAML==6.0.4
pyzmq==27.3.0
redis==8.1.0
regex==2026.11.19
requests==2.34.2
rich==15.0.0
safetensors==0.8.0
setuptools-scm==10.3.4
shellingham==1.5.4
sortedcontainers==2.4.0
starlette==1.10.0
sympy==1.14.0
tokenizers==0.23.3
torch==2.13.0
tqdm==4.70.1
transformers==5.24.0
triton==3.7.1
truststore==0.10.5
typer==0.29.2
typing-inspection==0.4.5
typing_extensions==4.16.0
urllib3==2.8.0
uvicorn==0.54.0
vcs-versioning==2.6.0
yarl==1.25.1
zipp==4.1.2
PINS
"$venv/bin/pip" install --quiet --disable-pip-version-check -c "$venv/.constraints" \
  torch==2.13.0 lmcache==0.5.6
cp "$here/setup-lmcache-venv.sh" "$stamp"
