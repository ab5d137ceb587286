#!/bin/sh
# Print the base's Secrets with fresh random values, to apply over the dev placeholders of base/secrets.yaml:
#   deploy/k8s/make-secrets.sh | kubectl apply -n NAMESPACE -f -
# then restart NATS and the actors so that they read the new values:
#   kubectl rollout restart -n NAMESPACE statefulset/actorserve-nats deployment -l app.kubernetes.io/name=actorserve
# Keys: the NATS roles of control/ops/nats_roles.py and the operator user (Secret actorserve-nats-roles), the
# operator's bearer token (Secret actorserve-operator). Needs kubectl (client only: --dry-run=client).
set -eu
# A letter, then 32 URL-safe characters: nats-server parses a variable's value as a config token, and a value
# starting with a digit or '-' would be read as a number or a date (docs/deployment.md, "Secrets").
rand() { printf '%s%s' "$(LC_ALL=C tr -dc 'A-Za-z' </dev/urandom | head -c 1)" \
  "$(head -c 24 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"; }
args=""
for role in operator gateway validator scheduler worker jobs control; do
  args="$args --from-literal=$role=$(rand)"
done
# shellcheck disable=SC2086  # word splitting of $args is intended (no spaces in the values)
kubectl create secret generic actorserve-nats-roles $args --dry-run=client -o yaml \
  | sed 's/^metadata:/metadata:\n  labels:\n    app.kubernetes.io\/name: actorserve\n    app.kubernetes.io\/part-of: actorserve/'
echo "---"
kubectl create secret generic actorserve-operator --from-literal=token="$(rand)" --dry-run=client -o yaml \
  | sed 's/^metadata:/metadata:\n  labels:\n    app.kubernetes.io\/name: actorserve\n    app.kubernetes.io\/part-of: actorserve/'
