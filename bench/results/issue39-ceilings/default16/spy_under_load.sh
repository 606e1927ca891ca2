#!/bin/bash
# usage: spy_under_load.sh POLICY OUT: 16 streams of POLICY (ab_servers.py, 6 rounds) against the running
# `edgespec serve` on 8124, its threads sampled by py-spy (installed in /tmp/spyenv) for 15 s into OUT (raw)
cd /work/main
PID=$(pgrep -f "edgespec serve" | head -1)
(.venv/bin/python bench/results/issue39-load-rate/ab_servers.py 16 6 256 x=http://127.0.0.1:8124=$1 > /tmp/load_$1.txt 2>&1 &)
sleep 4
/tmp/spyenv/bin/py-spy record -p $PID -d 15 -r 200 --threads --idle -f raw -o $2 --nonblocking > /dev/null 2>&1
sleep 30
cat /tmp/load_$1.txt
