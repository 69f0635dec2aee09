# Sourced by the deepspeed launch scripts, whose launcher does not restart a failed job itself (torchrun's
# --max-restarts does): `restarting <command...>` runs the command, and after a failure runs it again, up to
# MAX_RESTARTS times (default 3). The command carries train.resume=auto and a pinned hydra.run.dir, so each attempt
# continues from the newest intact checkpoint. Exit 0, bad input (2) and a stop on purpose (130 SIGINT, 143
# SIGTERM / SIGUSR1: a checkpoint was written) are final.
restarting() {
  local attempt status
  for attempt in $(seq 0 "${MAX_RESTARTS:-3}"); do
    status=0
    "$@" || status=$?
    case $status in 0|2|130|143) return "$status" ;; esac
    echo "launch: the job failed (exit $status) on attempt $((attempt + 1)); restarting from its newest checkpoint" >&2
  done
  return "$status"
}
