# The regen image: producer, generate worker and tokenize worker. CPU only and the same
# on GPU hosts: the generate worker talks to SGLang over HTTP, so neither the `sglang`
# nor the `local` extra (torch) is installed. See compose.yaml for how it is run.
FROM python:3.11-slim

# REGEN_HOME holds caches (converted tokenizers); never an embedded Redis, because
# compose gives every service REGEN_REDIS_URL.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    REGEN_HOME=/var/lib/regen

WORKDIR /src
# Dependencies in their own layer, read from pyproject.toml: editing the code does not
# reinstall them.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

COPY regen regen
COPY common common
COPY consumers consumers
COPY producer producer
RUN pip install --no-deps .

# Not root. /shards exists owned by regen so a named volume mounted there inherits it.
RUN useradd --create-home --uid 1000 regen \
    && mkdir -p /shards "$REGEN_HOME" \
    && chown regen:regen /shards "$REGEN_HOME"
USER regen
WORKDIR /home/regen

# Prometheus metrics of the generate (9100) and tokenize (9101) workers in compose.yaml.
EXPOSE 9100 9101
ENTRYPOINT ["regen"]
CMD ["--help"]
