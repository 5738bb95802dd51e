#!/usr/bin/env bash
# `make run`: everything for one machine under scripts/supervise.py (see Procfile), which restarts a
# process that exits (with backoff) and keeps the others running. Ctrl-C stops it all.
# Each process's whole output goes to var/log/<name>.log (0600; at 32 MiB it becomes <name>.log.1); the
# terminal shows process starts, exits and restarts, job and node events, warnings and errors.
# TRAINYARD_RUN_VERBOSE=1 (or `make run VERBOSE=1`) shows every line there too, as before.
set -euo pipefail
cd "$(dirname "$0")/.."
# Everything this starts writes its files for this user only: the database, the secret key, the admin
# password, the agents' run directories (config.json holds REDIS_URL with any password), Redis's data.
umask 077
export WEB_PORT="${PORT:-8000}"
export REDIS_PORT="${REDIS_PORT:-6390}"
USER_REDIS_URL="${REDIS_URL:-}"
export REDIS_URL="${REDIS_URL:-redis://127.0.0.1:${REDIS_PORT}/0}"
export TRAINYARD_VAR_DIR="${TRAINYARD_VAR_DIR:-$PWD/var}"
export TRAINYARD_DATA_ROOT="${TRAINYARD_DATA_ROOT:-$TRAINYARD_VAR_DIR/data}"
export TRAINYARD_CHECKPOINT_ROOT="${TRAINYARD_CHECKPOINT_ROOT:-$TRAINYARD_VAR_DIR/checkpoints}"
export TRAINYARD_RUN_DIR="${TRAINYARD_RUN_DIR:-$TRAINYARD_VAR_DIR/agents}"
export NODE_SLOTS="${NODE_SLOTS:-2}"
export PYTHONUNBUFFERED=1
LOG_DIR="$TRAINYARD_VAR_DIR/log"
case "${TRAINYARD_RUN_VERBOSE:-0}" in
  0) verbose=() ;;
  1) verbose=(--verbose) ;;
  *) echo "TRAINYARD_RUN_VERBOSE must be 1 (every line on the terminal) or 0, not '${TRAINYARD_RUN_VERBOSE}'" >&2; exit 1 ;;
esac
mkdir -p "$TRAINYARD_VAR_DIR/redis" "$TRAINYARD_DATA_ROOT" "$TRAINYARD_CHECKPOINT_ROOT" "$TRAINYARD_RUN_DIR" "$LOG_DIR"
# ... and what an older version left readable by others is tightened (0700 directories). The data
# root is what jobs read (read-only, as their own uids in the sandbox): readable, not writable.
chmod go-rwx "$TRAINYARD_VAR_DIR" "$TRAINYARD_VAR_DIR/redis" "$TRAINYARD_RUN_DIR" "$LOG_DIR"
chmod 0755 "$TRAINYARD_DATA_ROOT"
# The node agents run every job in a sandbox of its own (bubblewrap, the attempt's own uid:
# workers/sandbox.py), which needs root; they refuse to start without it.
if [ "$(id -u)" -ne 0 ] && [ "${TRAINYARD_INSECURE_NO_SANDBOX:-}" != "1" ]; then
  echo "make run: the node agents sandbox every job (bubblewrap namespaces, a uid per attempt), which needs" >&2
  echo "root: run 'sudo make run', or 'TRAINYARD_INSECURE_NO_SANDBOX=1 make run' to run jobs unsandboxed as you" >&2
  exit 1
fi
for port in "$WEB_PORT" "$REDIS_PORT"; do
  if .venv/bin/python -c "import socket,sys; s=socket.socket(); sys.exit(s.connect_ex(('127.0.0.1', $port)) != 0)"; then
    echo "port $port on 127.0.0.1 is already in use; set PORT (web) or REDIS_PORT to a free one" >&2
    exit 1
  fi
done
.venv/bin/python manage.py migrate --noinput -v 0
.venv/bin/python manage.py collectstatic --noinput -v 0
login=$(.venv/bin/python manage.py ensure_admin)
# The two local agents are registered like any node (issue 16): a fresh credential each start, 0600 under
# var/credentials/, which the Procfile hands them (--credential-file); their reports are signed with it.
for node in "node-a 127.0.0.1" "node-b 127.0.0.2"; do
  set -- $node
  .venv/bin/python manage.py node_add "$1" --address "$2" --slots "$NODE_SLOTS" --labels rack=r1 --reissue \
    --credential-out "$TRAINYARD_VAR_DIR/credentials/$1"
done
# Redis with ACL users (trainyard/redis_acl.py): the default user off, one user for the control plane and
# one per agent, passwords 0600 under var/credentials/ (kept across restarts), only their SHA-256 in the ACL
# file. A REDIS_URL you set yourself (another Redis) is used unchanged by every process.
.venv/bin/python -m trainyard.redis_acl write --dir "$TRAINYARD_VAR_DIR" --nodes node-a node-b >/dev/null
acl_url() { .venv/bin/python -m trainyard.redis_acl url --dir "$TRAINYARD_VAR_DIR" --user "$1" --base "$REDIS_URL"; }
if [ -z "$USER_REDIS_URL" ]; then
  REDIS_URL_NODE_A=$(acl_url node-a); REDIS_URL_NODE_B=$(acl_url node-b); REDIS_URL=$(acl_url trainyard-control)
else
  REDIS_URL_NODE_A=$REDIS_URL; REDIS_URL_NODE_B=$REDIS_URL
fi
export REDIS_URL REDIS_URL_NODE_A REDIS_URL_NODE_B
redis_shown=$(.venv/bin/python -c "import os; from trainyard.private import redacted_url; print(redacted_url(os.environ['REDIS_URL']))")
cat <<MSG

  Trainyard is starting:  http://127.0.0.1:${WEB_PORT}/
  Login:                  ${login}
  API token:              .venv/bin/python manage.py api_token admin   (a new one each time, shown once)
  Redis:                  ${redis_shown}   (Ctrl-C stops everything)
  Logs:                   ${LOG_DIR}/<process>.log   (shown here: starts, exits, jobs, warnings, errors;
                          TRAINYARD_RUN_VERBOSE=1 make run shows every line)

MSG
# Redis is stopped last: the agents report the attempts they stop through it. The processes' control-plane
# log lines start with their level and logger (TRAINYARD_LOG_FORMAT=levels): what the supervisor filters on.
TRAINYARD_LOG_FORMAT="${TRAINYARD_LOG_FORMAT:-levels}" exec .venv/bin/python scripts/supervise.py --procfile Procfile \
  --status-file "$TRAINYARD_VAR_DIR/supervisor.json" --stop-last redis --log-dir "$LOG_DIR" "${verbose[@]}"
