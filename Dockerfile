# One image for every role: node plugin (`stoker csi`), mounter (`stoker csi-mounter`), controller
# (`stoker csi --mode controller`) and operator (`stoker operator`).
#   docker build -t ghcr.io/stoker-dev/stoker:0.1.0 .
FROM python:3.12-slim-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends gcc \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fusecore fusecore
COPY csi csi
COPY operator operator
COPY stoker stoker
COPY bench bench
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.12-slim-bookworm
# fuse3: fusermount3 and the kernel interface; util-linux: mount/umount for bind mounts;
# tini: PID 1 that reaps the detached mount processes the mounter starts.
RUN apt-get update && apt-get install -y --no-install-recommends fuse3 util-linux tini \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER 0
ENTRYPOINT ["/usr/bin/tini", "--", "stoker"]
CMD ["--help"]
