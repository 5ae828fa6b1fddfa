#!/usr/bin/env bash
# upload.sh SRC DEST: sync a results directory to gs://bucket/prefix, s3://bucket/prefix,
# ais://bucket/prefix or a directory with the project's own uploader (no gsutil or aws CLI),
# skipping files already there unchanged. Credentials: GOOGLE_APPLICATION_CREDENTIALS /
# application default credentials (or STORAGE_EMULATOR_HOST); the AWS settings (AWS_PROFILE or
# the access keys, AWS_ENDPOINT_URL, AWS_REGION); AIS_ENDPOINT and AIS_AUTHN_TOKEN for AIStore.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# a Python with the package imagenet-ais installed: the checkout's venv (./run venv), or the image's
python=python3
[ -x "$here/.venv/bin/python" ] && python=$here/.venv/bin/python
exec "$python" -m imagenet_ais.cli.upload "$@"
