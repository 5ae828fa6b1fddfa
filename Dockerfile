# The training image: NGC's PyTorch (torch, torchvision, CUDA, NCCL, DALI) plus this project.
# Build with ./run build; the base tag is a build argument (BASE_IMAGE in config.sh).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace/imagenet-ais

# Install against the image's own pins (/etc/pip/constraint.txt since 25.03), and fail the
# build if that would replace the image's torch build.
COPY requirements.txt .
RUN torch_before=$(python -c 'import torch; print(torch.__version__)') \
    && constraints=() \
    && if [ -f /etc/pip/constraint.txt ]; then constraints=(-c /etc/pip/constraint.txt); fi \
    && pip install --no-cache-dir "${constraints[@]}" -r requirements.txt \
    && test "$(python -c 'import torch; print(torch.__version__)')" = "$torch_before"

COPY . .

# The checkout as the package imagenet-ais (its dependencies came in above); editable, so the
# checkout ./run shell mounts over this one is the code that runs.
RUN pip install --no-cache-dir --no-deps --no-build-isolation --editable .

# Runs as any user (docker run --user, NGC): code read-only for all, caches in /tmp.
# VENV=/usr: ./run uses the image's Python as it is, and makes no venv.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VENV=/usr \
    XDG_CACHE_HOME=/tmp/.cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/inductor
RUN chmod -R a+rX /workspace/imagenet-ais

CMD ["./run", "help"]
