#!/bin/bash
# This issue's first H200 run shared one call with issue 13's landed-code check: the script is
# docs/measurements/issue13/run11/landed/run.sh. Its KVarN line:
#   sfx test-backend --device cuda --op kvarn_attention --op attention --op rope_attention
exec bash docs/measurements/issue13/run11/landed/run.sh "$@"
