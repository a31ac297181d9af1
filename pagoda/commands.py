"""What the commands agree on: the ServingConfig fields each one has no flag for, and the exit code
of a refused configuration. pagoda/cli.py builds its parsers from these, pagoda/up.py its
children's command lines; neither imports the other at module level."""

# ServingConfig fields a command has no flag for: the worker never talks to Redis, only a worker
# beats, and `pagoda up` sets these itself for each engine group and worker it starts.
SCHEDULER_EXCLUDES = frozenset({"heartbeat_file", "dist_init_address"})
# the scheduler's Redis-side settings mean nothing to a worker (--drain-timeout stays: it always took it)
WORKER_EXCLUDES = frozenset({"redis_url", "claim_interval_s", "claim_idle_ms", "worker_silence_s", "engine_id"})
UP_EXCLUDES = frozenset({"redis_url", "zmq_address", "dist_init_address", "engine_id", "heartbeat_file"})
EXIT_CONFIG_ERROR = 2  # a command refused its configuration (pagoda up stops rather than restart it)
