"""`pdserve up`: Redis, prefill, decode and gateway as supervised child processes on one machine.

    config.py   UpConfig: the flags (vLLM spellings), frozen once
    cores.py    split the machine's cores between the engine processes
    plan.py     the child command lines, ports and health probes (pure)
    prereqs.py  redis-server present, model converted
    process.py  ChildProcess: own process group, dies with the launcher, prefixed log lines
    health.py   Redis PING, gRPC health, HTTP /health probes
    up.py       start, wait for health, print the URL, drain and stop on SIGINT / SIGTERM
"""
