#!/usr/bin/env bash
# Takes the README screenshots from real runs in a real terminal on a virtual X display (Xvfb),
# captured with ImageMagick's `import`.
#
#   screenshots/take.sh                  # all three shots
#   screenshots/take.sh train monitor    # some of: train monitor monitor-cpu-only
#
# The terminal is sakura (VTE, the terminal widget of GNOME Terminal), which draws block,
# box-drawing and braille cells itself, seamlessly; TERMINAL=xterm uses xterm instead (its
# font-drawn full blocks leave a thin gap between rows).
#
# Needs (Debian/Ubuntu): apt-get install xvfb xdotool imagemagick fonts-dejavu-core and
# sakura (or xterm). Uses $COCKPIT if set, else builds target/release/cockpit (any build of
# the current tree will do: COCKPIT=target/debug/cockpit). Run from anywhere; writes the PNGs
# to $OUT (default: this folder).
#
# Shots:
#   train.png             `cockpit train` (the embedded default, real training) once the run's
#                         metrics.jsonl reaches step $TRAIN_STEP (past the first eval at step 100),
#                         or after $TRAIN_MAX_SECS, whichever comes first
#   monitor.png           `cockpit monitor --replay tests/traces/hot_and_full.jsonl` after
#                         $MONITOR_SECS: a replay of a synthetic trace ("Synthetic GPU 80GB", a
#                         hot, nearly full GPU), so the GPU panels have data on a machine without
#                         one; the dashboard's header says REPLAY. A real GPU job recorded with
#                         `cockpit monitor --record trace.jsonl` replays the same way.
#   monitor-cpu-only.png  `cockpit monitor` live on this machine after $CPU_MONITOR_SECS
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
cd "$repo"

TRAIN_STEP=${TRAIN_STEP:-130}
TRAIN_MAX_SECS=${TRAIN_MAX_SECS:-300}
MONITOR_SECS=${MONITOR_SECS:-50}
CPU_MONITOR_SECS=${CPU_MONITOR_SECS:-30}
COLS=${COLS:-160}
ROWS=${ROWS:-48}
FONT=${FONT:-DejaVu Sans Mono}
FONT_SIZE=${FONT_SIZE:-11}
DISPLAY_NUM=${DISPLAY_NUM:-97}
TERMINAL=${TERMINAL:-sakura}
OUT=${OUT:-$here}

for tool in Xvfb xdotool import "$TERMINAL"; do
    command -v "$tool" >/dev/null || { echo "take.sh: $tool is not installed" >&2; exit 1; }
done
case $TERMINAL in
    sakura | xterm) ;;
    *) echo "take.sh: TERMINAL must be sakura or xterm" >&2; exit 2 ;;
esac

if [[ -z "${COCKPIT:-}" ]]; then
    cargo build --release
    COCKPIT=$repo/target/release/cockpit
fi

work=$(mktemp -d)
xvfb_pid=
cleanup() {
    if [[ -n "$xvfb_pid" ]]; then
        kill "$xvfb_pid" 2>/dev/null || true
        wait "$xvfb_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# The terminal's settings live in the scratch folder, never in the user's config.
export XDG_CONFIG_HOME=$work/config
mkdir -p "$XDG_CONFIG_HOME/sakura"
cat >"$XDG_CONFIG_HOME/sakura/sakura.conf" <<EOF
[sakura]
font=$FONT $FONT_SIZE
colorset1_fore=rgb(255,255,255)
colorset1_back=rgb(0,0,0)
colorset1_curs=rgb(255,255,255)
last_colorset=1
scrollbar=false
show_tab_bar=never
less_questions=true
use_fading=false
blinking_cursor=false
audible_bell=No
EOF

# A screen larger than any terminal we open; each shot is of the terminal window alone.
Xvfb ":$DISPLAY_NUM" -screen 0 2400x1400x24 -nolisten tcp >"$work/xvfb.log" 2>&1 &
xvfb_pid=$!
export DISPLAY=":$DISPLAY_NUM"
for _ in $(seq 50); do
    xdotool getdisplaygeometry >/dev/null 2>&1 && break
    kill -0 "$xvfb_pid" 2>/dev/null || { echo "take.sh: Xvfb failed:" >&2; cat "$work/xvfb.log" >&2; exit 1; }
    sleep 0.1
done

# The last training step the run has logged (0 before the first).
train_step() {
    local metrics=$work/train-run/metrics.jsonl step=
    [[ -f $metrics ]] && step=$(tail -n 100 "$metrics" | grep -o '"event":"step","step":[0-9]*' |
        tail -n 1 | grep -o '[0-9]*$') || true
    echo "${step:-0}"
}

# wait_train: until the run reaches $TRAIN_STEP, at most $TRAIN_MAX_SECS.
wait_train() {
    local deadline=$((SECONDS + TRAIN_MAX_SECS))
    while (($(train_step) < TRAIN_STEP && SECONDS < deadline)); do sleep 1; done
    sleep 2 # the dashboard redraws a few times a second; let it catch up
}

# shoot NAME WAIT COMMAND...: runs COMMAND in a fresh terminal, runs WAIT (a command, e.g.
# `sleep 30`), then captures the terminal window.
shoot() {
    local name=$1 wait=$2
    shift 2
    # UTF-8 and truecolor either way (VTE sets COLORTERM itself; xterm draws 24-bit colours).
    if [[ $TERMINAL == sakura ]]; then
        LC_ALL=C.UTF-8 sakura --columns "$COLS" --rows "$ROWS" -e "$@" &
    else
        COLORTERM=truecolor LC_ALL=C.UTF-8 xterm -u8 -tn xterm-256color \
            -fa "$FONT" -fs "$FONT_SIZE" -bg black -fg white -b 0 -bw 0 +sb \
            -geometry "${COLS}x${ROWS}+0+0" -e "$@" &
    fi
    local term_pid=$!
    local wid=
    for _ in $(seq 100); do
        wid=$(xdotool search --onlyvisible --pid "$term_pid" 2>/dev/null | head -n1) || true
        [[ -n "$wid" ]] && break
        sleep 0.1
    done
    [[ -n "$wid" ]] || { echo "take.sh: no terminal window for $name" >&2; exit 1; }
    $wait
    import -window "$wid" "$work/$name.png"
    # Smaller files: the dashboard uses few colours.
    if command -v pngquant >/dev/null; then
        pngquant --force --output "$OUT/$name.png" 256 "$work/$name.png"
    else
        cp "$work/$name.png" "$OUT/$name.png"
    fi
    kill "$term_pid" 2>/dev/null || true
    wait "$term_pid" 2>/dev/null || true
    echo "wrote $OUT/$name.png"
}

want=("$@")
[[ ${#want[@]} -gt 0 ]] || want=(train monitor monitor-cpu-only)
for shot in "${want[@]}"; do
    case $shot in
        train)
            shoot train wait_train "$COCKPIT" train --run-dir "$work/train-run" ;;
        monitor)
            shoot monitor "sleep $MONITOR_SECS" "$COCKPIT" monitor \
                --replay "$repo/tests/traces/hot_and_full.jsonl" --replay-speed 1 \
                --out-dir "$work/monitor-replay" ;;
        monitor-cpu-only)
            shoot monitor-cpu-only "sleep $CPU_MONITOR_SECS" "$COCKPIT" monitor \
                --out-dir "$work/monitor-live" ;;
        *)
            echo "take.sh: unknown shot $shot (train, monitor, monitor-cpu-only)" >&2; exit 2 ;;
    esac
done
