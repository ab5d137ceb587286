#!/bin/sh
# Print a .env for docker-compose.yml with fresh random secrets:  deploy/compose/make-env.sh > .env
# (the NATS password of every role of control/ops/nats_roles.py and of the operator user, the operator token).
# Keep .env out of version control (.gitignore) and readable by you only (chmod 600 .env).
set -eu
# A letter, then 32 URL-safe characters: nats-server parses a variable's value as a config token, and a value
# starting with a digit or '-' would be read as a number or a date (docs/deployment.md, "Secrets").
rand() { printf '%s%s' "$(LC_ALL=C tr -dc 'A-Za-z' </dev/urandom | head -c 1)" \
  "$(head -c 24 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')"; }
umask 077
for role in OPERATOR GATEWAY VALIDATOR SCHEDULER WORKER JOBS CONTROL; do
  echo "ACTORSERVE_NATS_PASSWORD_${role}=$(rand)"
done
echo "ACTORSERVE_OPERATOR_TOKEN=$(rand)"
echo "ACTORSERVE_TENANT=demo"
