# The autotune service: REST API and profile store. No torch: the `server` extra only.
#   docker build -t autotune-server .
#   docker run -p 8000:8000 -e AUTOTUNE_API_TOKENS=ci=change-me -v autotune-data:/data autotune-server
# PostgreSQL instead of the SQLite file on the volume:
#   -e AUTOTUNE_DATABASE_URL=postgresql+psycopg://user:pass@db:5432/autotune
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY autotune ./autotune
COPY server ./server
COPY client ./client
RUN python -m venv /opt/venv && /opt/venv/bin/pip install --quiet ".[server]"

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    AUTOTUNE_DATABASE_URL=sqlite:////data/autotune.db \
    AUTOTUNE_HOST=0.0.0.0 \
    AUTOTUNE_PORT=8000
RUN groupadd --system autotune && useradd --system --gid autotune --home-dir /data autotune \
    && mkdir -p /data && chown autotune:autotune /data
COPY --from=build /opt/venv /opt/venv
COPY docker/entrypoint.sh /usr/local/bin/autotune-entrypoint
RUN chmod 0755 /usr/local/bin/autotune-entrypoint
USER autotune
VOLUME ["/data"]
EXPOSE 8000
# Liveness only (no database): an orchestrator uses /readyz for routing.
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('AUTOTUNE_PORT', '8000'), timeout=2)"
ENTRYPOINT ["/usr/local/bin/autotune-entrypoint"]
