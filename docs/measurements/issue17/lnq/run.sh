#!/usr/bin/env bash
# LNQ (GuidedQuant) look-up-table bases on SmolLM2 (issue 17, item 1), CPU: the protocol of
# docs/measurements/issue17/sqllm/run.sh (same calibration, --fit, k = 16, wiki:8 KL to the float
# GGUF), whose sqllmN / awqN / rtnN / qtip4 rows they are compared with.
# BIN=target/release (or any folder with sfx-convert and sfx-run), OUT=results folder.
here="$(dirname "$0")"
OUT=${OUT:-$here/out} QUANTS=${QUANTS:-"lnq3 lnq4"} exec bash "$here/../sqllm/run.sh"
