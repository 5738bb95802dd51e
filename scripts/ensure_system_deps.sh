#!/usr/bin/env bash
# Install the Debian packages Trainyard needs when they are missing: redis-server (broker, streams,
# channel layer), bubblewrap and util-linux's setpriv/prlimit (the node agents' job sandbox,
# workers/sandbox.py), and those named as arguments (chromium, iproute2, postgresql for `make
# test-postgres`, slurm for `make test-slurm`: slurm-wlm's slurmctld/slurmd/sbatch and munge). Root installs them with apt-get; anyone else gets the exact command to run.
set -euo pipefail
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
{ command -v setpriv && command -v prlimit; } >/dev/null 2>&1 || missing+=(util-linux)
for pkg in "$@"; do
  case "$pkg" in
    chromium) [ -x /usr/bin/chromium ] || missing+=(chromium) ;;
    # the server binaries live in /usr/lib/postgresql/<version>/bin (tests/postgres.py finds them)
    postgresql) compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql) ;;
    # Debian's slurm-wlm carries slurmctld, slurmd and the client commands; munge authenticates them
    slurm) { command -v slurmctld && command -v slurmd && command -v sbatch; } >/dev/null 2>&1 || missing+=(slurm-wlm)
           command -v munged >/dev/null 2>&1 || missing+=(munge) ;;
    *) dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg") ;;
  esac
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "Trainyard needs these Debian packages: ${missing[*]}" >&2
  echo "Install them with:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
echo "installing Debian packages: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
