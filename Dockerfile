# One image for web, worker, gpu-worker and mlflow (docker-compose.yml).
#   CPU (default):  docker build .
#   GPU worker:     docker build --build-arg EXTRAS=gpu --build-arg TORCH_INDEX_URL=https://pypi.org/simple .
FROM python:3.11-slim

ARG EXTRAS=""
# The CPU build of torch by default, so that web and CPU-worker images stay small; the GPU image takes
# PyPI's CUDA build.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    FLYWHEEL_VAR_DIR=/data \
    FLYWHEEL_STATIC_ROOT=/app/staticfiles

RUN apt-get update \
    && apt-get install -y --no-install-recommends curl libpq5 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first, pinned, from the chosen index (it is the largest layer and changes least).
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0

COPY pyproject.toml README.md manage.py ./
COPY platform ./platform
COPY trainer ./trainer
COPY templates ./templates
COPY static ./static
RUN pip install -e ".${EXTRAS:+[${EXTRAS}]}"

# Static files are collected into the image, at FLYWHEEL_STATIC_ROOT (outside the /data volume, which would
# hide them); in production whitenoise serves them from there and nowhere else.
RUN SECRET_KEY=build-only FLYWHEEL_ENV=production DATABASE_URL=sqlite:////tmp/build.sqlite3 \
    FLYWHEEL_VAR_DIR=/tmp/build-var python manage.py collectstatic --noinput \
    && rm -rf /tmp/build.sqlite3 /tmp/build-var

# Named volumes mounted on these folders take their owner from the image.
RUN useradd --create-home --uid 1000 flywheel && mkdir -p /data /mlartifacts && chown flywheel /data /mlartifacts
USER flywheel

EXPOSE 8000
CMD ["gunicorn", "flywheel.wsgi", "--bind", "0.0.0.0:8000", "--workers", "4", "--access-logfile", "-"]
