# syntax=docker/dockerfile:1
#
# One image for both programs:
#   docker run IMAGE                          -> outbox-relay (the default CMD)
#   docker run IMAGE outbox-relay migrate     -> apply the schema (idempotent)
#   docker run IMAGE outbox-resolver          -> the resolver
# Every setting is an OUTBOX_* environment variable (see outbox_relay/runtime/options.py).

# --- build: one wheel for the project and one for each dependency -------------------------
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# .dockerignore keeps the context to what the wheel is built from.
COPY . .
# The wheel ships the top-level sql/ folder as the package outbox_relay.sql (see pyproject.toml),
# so `outbox-relay migrate` works from the installed image. The extra binary brings psycopg's
# own libpq (the slim image has none); the project itself depends on plain psycopg.
RUN pip wheel ".[binary]" --wheel-dir /wheels

# --- runtime: the wheels installed offline, nothing else ---------------------------------
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN groupadd --system --gid 10001 outbox \
    && useradd --system --uid 10001 --gid outbox --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin outbox

# Bind-mount the wheels instead of COPYing them, so they never become a layer of the image.
RUN --mount=type=bind,from=build,source=/wheels,target=/wheels \
    pip install --no-index --find-links=/wheels "outbox-relay[binary]"

# Numeric, so runtimes that enforce "runAsNonRoot" can check it without /etc/passwd.
USER 10001:10001

# /metrics of outbox-relay (OUTBOX_METRICS_PORT default) and of outbox-resolver.
EXPOSE 9460 9461
# The programs listen on loopback unless told otherwise; in a container, Prometheus and the
# kubelet's probes come from outside it (the pod's or the container's address), and the
# container's own network is the boundary: every address of it. Publish the port (-p) or
# open it with a NetworkPolicy only where the scraper needs it.
ENV OUTBOX_METRICS_HOST=0.0.0.0

# No ENTRYPOINT and no init: the program is PID 1 and handles SIGTERM itself (finish or roll
# back the batch in flight, then exit 0). Exec form, so the signal reaches Python directly.
CMD ["outbox-relay"]
