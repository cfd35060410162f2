# One image for the API and the workers: `ckptconv serve` (default) or `ckptconv worker`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
# Dependencies change less often than the code: install them in their own layer, from the lock
# (every package pinned with its hashes: what CI tested). torch is pinned there as the CPU build
# 2.13.0+cpu, which only PyTorch's CPU index serves; the default wheel would pull gigabytes of CUDA.
COPY requirements.lock ./
RUN pip install --require-hashes -r requirements.lock --extra-index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY ckptconv ./ckptconv
COPY service ./service
COPY worker ./worker
RUN pip install --no-deps --no-build-isolation . && rm -rf build *.egg-info

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin ckptconv
USER ckptconv
WORKDIR /home/ckptconv

EXPOSE 8000
ENTRYPOINT ["ckptconv"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
