# One image for the API and the workers: `ckptconv serve` (default) or `ckptconv worker`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# The CPU build of torch first, from its own index: the default wheel pulls gigabytes of CUDA.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

WORKDIR /app
# Dependencies change less often than the code: install them in their own layer.
COPY pyproject.toml README.md ./
RUN mkdir -p ckptconv service worker \
    && touch ckptconv/__init__.py service/__init__.py worker/__init__.py \
    && pip install . \
    && pip uninstall -y ckptconv \
    && rm -rf ckptconv service worker build *.egg-info
COPY ckptconv ./ckptconv
COPY service ./service
COPY worker ./worker
RUN pip install --no-deps . && rm -rf build *.egg-info

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin ckptconv
USER ckptconv
WORKDIR /home/ckptconv

EXPOSE 8000
ENTRYPOINT ["ckptconv"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--workers", "2"]
