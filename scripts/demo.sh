#!/usr/bin/env bash
# Set everything up, then run the main job end to end on this machine: two
# hosts on loopback, each with its own state and mount, a stub model provider,
# and one agent that runs, has its memory edited, changes model, and moves to
# the other host while running. `ls` and `cat` show each step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

work=$(mktemp -d -t capsulefs-demo.XXXXXX)
# As root each agent runs as a uid of its own, which must pass through here
# to reach its sandbox and its capsule in the mount (0711: pass, not list).
chmod 711 "$work"
CFS=.venv/bin/capsulefs
pids=()
cleanup() {
    for m in "$work/mnt-a" "$work/mnt-b"; do
        mountpoint -q "$m" 2>/dev/null && $CFS umount "$m" >/dev/null 2>&1 || true
    done
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true  # the daemons and the stub have exited (and ended their agents)
    for m in "$work/mnt-a" "$work/mnt-b"; do
        mountpoint -q "$m" 2>/dev/null && umount -l "$m" || true
    done
    [ -n "${DEMO_KEEP:-}" ] || rm -rf "$work"
}
trap cleanup EXIT
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '$ %s\n' "$*"; "$@"; }
a() { $CFS --state "$work/a" "$@"; }
b() { $CFS --state "$work/b" "$@"; }
free_port() { .venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local limit=$1 what=$2; shift 2
    for _ in $(seq $((limit * 10))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "demo: timed out waiting for $what" >&2; exit 1
}
replies() { grep -c '"kind":"assistant_message"' "$1/memory/timeline_events.jsonl" || true; }
has_replies() { [ "$(replies "$1")" -ge "$2" ]; }
say_to() { printf '{"kind":"user_message","text":"%s"}\n' "$2" >> "$1/memory/timeline_events.jsonl"; }
last_reply() { grep '"kind":"assistant_message"' "$1/memory/timeline_events.jsonl" | tail -1 | .venv/bin/python -c 'import json,sys; print("-> the model said:", json.loads(sys.stdin.read())["text"])'; }

say "a stub model provider on loopback (speaks Anthropic, OpenAI Chat and Responses)"
stub_port=$(free_port)
.venv/bin/python -I -m capsulefs.testing.stub_provider --port "$stub_port" > "$work/stub.log" 2>&1 &
pids+=($!)
url="http://127.0.0.1:$stub_port"
wait_for 20 "the stub provider" .venv/bin/python -c "import socket; socket.create_connection(('127.0.0.1', $stub_port)).close()"

say "two hosts, A and B: identities, peers pinned by host id both ways"
port_a=$(free_port); port_b=$(free_port)
a init >/dev/null; b init >/dev/null
id_a=$(a id); id_b=$(b id)
run a peer add b "127.0.0.1:$port_b" "$id_b"
run b peer add a "127.0.0.1:$port_a" "$id_a"
for h in a b; do
    for k in ANTHROPIC_API_KEY OPENAI_API_KEY; do echo "stub-key" | $CFS --state "$work/$h" secret set "$k" >/dev/null; done
done

say "a new agent on A, running the reference agent against the stub"
cat > "$work/spec.json" <<JSON
{"version": 1, "entrypoint": ["capsulefs", "agent"],
 "env": {"ANTHROPIC_BASE_URL": "$url", "OPENAI_BASE_URL": "$url/v1"},
 "secrets": ["ANTHROPIC_API_KEY", "OPENAI_API_KEY"]}
JSON
run a new scout --spec "$work/spec.json"

say "mount both hosts (each daemon also listens for moves)"
mkdir -p "$work/mnt-a" "$work/mnt-b"
# (Started directly, not through a() and b(): $! is then the daemon itself,
# which the cleanup waits for, not a subshell around it.)
$CFS --state "$work/a" mount "$work/mnt-a" --listen "127.0.0.1:$port_a" --log-file "$work/a.log" &
pids+=($!)
$CFS --state "$work/b" mount "$work/mnt-b" --listen "127.0.0.1:$port_b" --log-file "$work/b.log" &
pids+=($!)
wait_for 30 "mount A" mountpoint -q "$work/mnt-a"
wait_for 30 "mount B" mountpoint -q "$work/mnt-b"
A="$work/mnt-a/scout"
run ls "$work/mnt-a" "$A" "$A/memory"
wait_for 30 "the agent process" grep -q '"state": "running"' "$A/.control/status"

say "pick a model and talk to the agent through its journal"
run sh -c "echo anthropic:claude-demo > '$A/.control/model'"
say_to "$A" "hello, who are you?"
wait_for 30 "a reply" has_replies "$A" 1
last_reply "$A"

say "edit its working memory in place, then with sed -i (a temp file renamed over it)"
run sh -c "printf '# notes\nThe user prefers long answers.\n' > '$A/memory/working_memory.md'"
run sed -i 's/long answers/short answers/' "$A/memory/working_memory.md"
run cat "$A/memory/working_memory.md"
say_to "$A" 'call write_file {\"path\": \"plan.md\", \"content\": \"1. move to host B\"}'

wait_for 30 "the tool round trip" has_replies "$A" 2
last_reply "$A"

say "B's operator lets the agent have B's keys: a spec only asks, and an agent moved in gets none on its own"
scout_id=$(a ls --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)[0]["agent_id"])')
run b secret grant "$scout_id" ANTHROPIC_API_KEY OPENAI_API_KEY

say "move the running agent from A to B (a fenced two-phase commit over mutual TLS)"
run sh -c "echo b > '$A/.control/move'"
run ls "$work/mnt-a" "$work/mnt-b"
B="$work/mnt-b/scout"
wait_for 30 "the agent process on B" grep -q '"state": "running"' "$B/.control/status"
run cat "$B/.control/status"

say "it carries on at B, on another provider, and back"
run sh -c "echo openai-chat:gpt-demo > '$B/.control/model'"
say_to "$B" "now on a different model"
wait_for 30 "a reply on B" has_replies "$B" 3
last_reply "$B"
run sh -c "echo anthropic:claude-demo > '$B/.control/model'"
say_to "$B" "and back to the first model"
wait_for 30 "another reply on B" has_replies "$B" 4
last_reply "$B"

say "the workspace file the agent wrote on A came along"
run cat "$work/b/sandboxes/$scout_id/workspace/plan.md"
echo

say "the journal lost nothing; a tar of the live capsule verifies"
run b log scout | tail -12
run tar -C "$B" -cf "$work/scout.tar" .
run b verify "$work/scout.tar"
echo
echo "demo finished: every step above worked"
