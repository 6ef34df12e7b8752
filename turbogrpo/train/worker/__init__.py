"""The asynchronous loop's rollout worker (train.max_staleness > 0) and how it talks to the trainer.

    rollout_worker.py   the trainer's side (RolloutWorker) and the worker's main
    protocol.py         what the two exchange: the worker's spec, requests, what is drawn, the worker's messages
    local.py            "local": a process the trainer spawns, weights through shared memory
    remote.py           "remote": a worker on another machine, over secure_channel.py's connection
    secure_channel.py   the authenticated, encrypted connection (the run's secret proved, AES-GCM records)
    wire.py             messages as JSON and tensors, never pickles
    weight_ring.py      the k + 1 versions of the weights each side keeps
    rollout_checks.py   a rollout checked against its request before it is trained on
    partial_rollouts.py generations carried from step to step (train.partial_rollouts)
"""
