#!/bin/bash
# Calls B1 and B2 (session 57): a real SmolLM2 LNQ file (sfx-convert --quant lnq3 --head q4,
# 113 MB with its ram-tier refinement columns) crosses in three carries; each of the first two
# stashes its part in /tmp/b for call B3. Usage: run_b1.sh PART (p0, p1).
mkdir -p /tmp/b && cp .gpu/lnq3.$1 /tmp/b/ && ls -la /tmp/b
