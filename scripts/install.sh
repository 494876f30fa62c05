#!/usr/bin/env bash
# Idempotent installer for a fresh Debian 12 machine (run as root, no stdin):
#   1. Debian packages that are missing: JDK 17+, Maven, PostgreSQL server and
#      client of one major version, procps, make, python3 with venv.
#   2. Maven-resolved jars: .local/kafka-libs (Kafka broker),
#      .local/spark-jars (Spark's Kafka source + PostgreSQL JDBC),
#      .local/connect-libs (a Kafka Connect worker) and
#      .local/connect-plugins/debezium-postgres (Debezium's PostgreSQL connector),
#      .local/connect-plugins/debezium-jdbc (Debezium's JDBC sink, the benchmark's peer),
#      with a project-local Maven repository in .local/m2; resolved in the
#      background while step 3 runs. Then .local/connect-plugins/eos-connect, the
#      project's own Connect predicate, compiled from connect/ with javac.
#   3. .venv with `pip install -c constraints.txt -e .[dev,spark]`.
# Each step is skipped when already done (pip and Maven steps are keyed by a
# hash of their inputs). One line of output per step; details go to
# .local/logs/install-*.log.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/config.sh
source "$here/config.sh"

export DEBIAN_FRONTEND=noninteractive
log_dir="$EOS_STATE_DIR/logs"
marker_dir="$EOS_STATE_DIR/markers"
mkdir -p "$log_dir" "$marker_dir"

step() { echo "install: $*"; }
die() { echo "install: ERROR: $*" >&2; exit 1; }
tail_log() { echo "----- last lines of $1 -----" >&2; tail -n "${2:-25}" "$1" >&2 || true; }

# ---------------------------------------------------------------- checks
java_major() {  # prints the major version of `java` on PATH, or nothing
  command -v java >/dev/null 2>&1 || return 0
  java -XshowSettings:properties -version 2>&1 \
    | sed -n 's/^ *java\.specification\.version = \([0-9.]*\).*/\1/p' | sed 's/^1\.//; s/\..*//' | head -1
}
java_ok() { local v; v=$(java_major); [ -n "$v" ] && [ "$v" -ge 17 ]; }

pg_major_ok() {  # a major version with server and client tools side by side
  local bin
  for bin in /usr/lib/postgresql/*/bin; do
    local ok=1 tool
    for tool in postgres initdb pg_ctl psql pg_dump pg_restore; do
      [ -x "$bin/$tool" ] || ok=0
    done
    [ "$ok" = 1 ] && return 0
  done
  return 1
}

python_ok() { command -v python3 >/dev/null 2>&1 && python3 -c 'import venv, ensurepip' >/dev/null 2>&1; }

# ---------------------------------------------------------------- 1. Debian packages
missing=()
java_ok && command -v javac >/dev/null 2>&1 || missing+=(openjdk-17-jdk-headless)
command -v mvn >/dev/null 2>&1 || missing+=(maven)
pg_major_ok || missing+=(postgresql postgresql-client)
command -v ps >/dev/null 2>&1 || missing+=(procps)
command -v make >/dev/null 2>&1 || missing+=(make)
python_ok || missing+=(python3 python3-venv)
command -v runuser >/dev/null 2>&1 || missing+=(util-linux)
# Headless Chromium renders the demo's HTML report in its end-to-end test.
command -v chromium >/dev/null 2>&1 || missing+=(chromium fonts-dejavu-core)

if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    die "missing system packages: ${missing[*]}. Install them as root: apt-get install ${missing[*]}"
  fi
  command -v apt-get >/dev/null 2>&1 \
    || die "missing: ${missing[*]}, and this is not a Debian-like system (no apt-get); install them by hand"
  step "apt-get install ${missing[*]}"
  apt_log="$log_dir/install-apt.log"
  apt-get update > "$apt_log" 2>&1 \
    || { tail_log "$apt_log"; die "apt-get update failed: the Debian package mirror is unreachable (check network/proxy and /etc/apt/sources.list*)"; }
  apt-get install -y --no-install-recommends "${missing[@]}" >> "$apt_log" 2>&1 \
    || { tail_log "$apt_log"; die "apt-get install ${missing[*]} failed (see $apt_log)"; }
else
  step "system packages present (java $(java_major), maven, postgresql, procps, make, python3)"
fi

java_ok || die "no Java 17+ on PATH (found: '$(java_major)'): apt-get install openjdk-17-jdk-headless, then select it with update-alternatives --config java"
command -v mvn >/dev/null 2>&1 || die "Maven (mvn) is missing: apt-get install maven"
pg_major_ok || die "PostgreSQL binaries are missing: need postgres, initdb, pg_ctl, psql, pg_dump and pg_restore of one major version in /usr/lib/postgresql/<major>/bin: apt-get install postgresql postgresql-client"
python_ok || die "python3 with the venv module is missing: apt-get install python3 python3-venv"

inputs_hash() { cat "$@" | sha256sum | cut -c1-16; }

# ---------------------------------------------------------------- 2. Maven jars (in the background)
dep_plugin="org.apache.maven.plugins:maven-dependency-plugin:3.8.1"

fetch_jars() {  # $1 name, $2 pom, $3 destination dir, $4... extra Maven args
  local name="$1" pom="$2" dest="$3"; shift 3
  local hash marker="$marker_dir/$name.sha" mvn_log="$log_dir/install-$name.log"
  hash=$(inputs_hash "$pom")
  if [ "$(cat "$marker" 2>/dev/null)" = "$hash" ] && ls "$dest"/*.jar >/dev/null 2>&1; then
    step "$name jars up to date ($dest)"; return
  fi
  step "resolving $name jars with Maven into $dest"
  local tmp="$dest.new"
  rm -rf "$tmp"
  if ! mvn -B -q -Dstyle.color=never -f "$pom" -Dmaven.repo.local="$EOS_STATE_DIR/m2" \
      "$dep_plugin:copy-dependencies" -DoutputDirectory="$tmp" "$@" > "$mvn_log" 2>&1; then
    tail_log "$mvn_log" 8
    if grep -qiE 'UnknownHost|Connection refused|connect timed out|Network is unreachable|No route to host|Could not transfer|Could not resolve' "$mvn_log"; then
      die "Maven could not download $name's jars: the Maven repository is unreachable (check network/proxy, or a <mirror> in ~/.m2/settings.xml). Log: $mvn_log"
    fi
    die "Maven failed to resolve $name's jars (see $mvn_log)"
  fi
  ls "$tmp"/*.jar >/dev/null 2>&1 || die "Maven resolved no jars for $name (see $mvn_log)"
  # Swap in the new set only if it differs, so a running broker keeps its files.
  if [ -d "$dest" ] && diff <(cd "$dest" && ls) <(cd "$tmp" && ls) >/dev/null \
      && (cd "$tmp" && sha256sum -- *) | (cd "$dest" && sha256sum --quiet -c -) >/dev/null 2>&1; then
    rm -rf "$tmp"
  else
    rm -rf "$dest"; mv "$tmp" "$dest"
  fi
  echo "$hash" > "$marker"
}

# The project's own Connect plugin (connect/): the predicate that drops Debezium's transaction
# BEGINs (docs/cdc.md). Compiled against the worker's connect-api, in a plugin folder of its own
# with its ServiceLoader manifest (the worker finds plugins by manifest only).
build_connect_plugin() {
  local src="$EOS_ROOT/connect" dest="$EOS_CONNECT_PLUGIN_PATH/eos-connect"
  local hash marker="$marker_dir/eos-connect.sha" build="$EOS_STATE_DIR/eos-connect-build"
  local sources
  mapfile -d '' sources < <(find "$src" -type f -print0 | sort -z)
  hash=$(inputs_hash "${sources[@]}" "$EOS_CONNECT_LIBS"/connect-api-*.jar)
  if [ "$(cat "$marker" 2>/dev/null)" = "$hash" ] && [ -f "$dest/eos-connect.jar" ]; then
    step "eos-connect plugin up to date ($dest)"; return
  fi
  step "building the eos-connect plugin into $dest"
  local classpath
  classpath=$(ls "$EOS_CONNECT_LIBS"/connect-api-*.jar "$EOS_CONNECT_LIBS"/kafka-clients-*.jar | paste -sd:)
  rm -rf "$build"; mkdir -p "$build/classes" "$dest"
  find "$src/src" -name '*.java' -print0 | xargs -0 javac --release 17 -Xlint:all -Werror \
      -cp "$classpath" -d "$build/classes" > "$build/javac.log" 2>&1 \
    || { tail_log "$build/javac.log"; die "javac failed on connect/ (see $build/javac.log)"; }
  cp -r "$src/META-INF" "$build/classes/"
  jar --create --file "$build/eos-connect.jar" -C "$build/classes" . \
    || die "jar failed to package connect/"
  mv "$build/eos-connect.jar" "$dest/eos-connect.jar"
  rm -rf "$build"
  echo "$hash" > "$marker"
}

fetch_all_jars() {
  fetch_jars kafka-libs "$EOS_ROOT/scripts/maven/kafka-broker.pom.xml" "$EOS_KAFKA_LIBS" -DincludeScope=runtime
  fetch_jars spark-jars "$EOS_ROOT/scripts/maven/spark-kafka-connector.pom.xml" "$EOS_SPARK_JARS_DIR" -U -DincludeScope=runtime
  # The Connect worker's classpath, and Debezium in a plugin folder of its own under plugin.path:
  # Connect loads each such folder in an isolated class loader, so Debezium's Jackson and
  # PostgreSQL driver never meet the worker's.
  fetch_jars connect-libs "$EOS_ROOT/scripts/maven/kafka-connect.pom.xml" "$EOS_CONNECT_LIBS" -DincludeScope=runtime
  mkdir -p "$EOS_CONNECT_PLUGIN_PATH"
  fetch_jars debezium-postgres "$EOS_ROOT/scripts/maven/debezium-postgres.pom.xml" \
    "$EOS_CONNECT_PLUGIN_PATH/debezium-postgres" -DincludeScope=runtime
  # Debezium's JDBC sink: the peer the CDC benchmark times the mirror against. The worker loads
  # it with the others; a connector of it exists only while the benchmark runs one.
  fetch_jars debezium-jdbc "$EOS_ROOT/scripts/maven/debezium-jdbc.pom.xml" \
    "$EOS_CONNECT_PLUGIN_PATH/debezium-jdbc" -DincludeScope=runtime
  build_connect_plugin
}

# Maven's downloads run while pip installs (they share nothing but the network): on a fresh
# machine that saves Maven's whole minute. Its lines are printed once pip is done.
jars_out="$log_dir/install-jars.out"
fetch_all_jars > "$jars_out" 2>&1 &
jars_pid=$!
trap 'kill "$jars_pid" 2>/dev/null || true' EXIT

# ---------------------------------------------------------------- 3. Python venv

if [ ! -x "$EOS_VENV/bin/python" ]; then
  step "creating $EOS_VENV with $(python3 --version 2>&1)"
  python3 -m venv "$EOS_VENV" || die "python3 -m venv $EOS_VENV failed: apt-get install python3-venv"
fi
py_hash=$(inputs_hash "$EOS_ROOT/constraints.txt" "$EOS_ROOT/setup.cfg" "$EOS_ROOT/pyproject.toml")
py_marker="$marker_dir/venv.sha"
if [ "$(cat "$py_marker" 2>/dev/null)" = "$py_hash" ] \
    && "$EOS_VENV/bin/python" -c 'import airflow_provider_eos, airflow, pyspark, pytest' >/dev/null 2>&1; then
  step "python packages up to date ($EOS_VENV)"
else
  step "pip install -c constraints.txt -e .[dev,spark] (a few minutes on a fresh machine)"
  pip_log="$log_dir/install-pip.log"
  (cd "$EOS_ROOT" && "$EOS_VENV/bin/pip" install --no-input --progress-bar off \
      -c constraints.txt -e '.[dev,spark]') > "$pip_log" 2>&1 \
    || { tail_log "$pip_log"; die "pip install failed (see $pip_log); if the package index is unreachable, check network/proxy and pip's index settings"; }
  echo "$py_hash" > "$py_marker"
fi

if ! wait "$jars_pid"; then
  cat "$jars_out" >&2
  exit 1
fi
trap - EXIT
cat "$jars_out"

step "done ($(ls "$EOS_KAFKA_LIBS" | wc -l) kafka jars, $(ls "$EOS_SPARK_JARS_DIR" | wc -l) spark jars, $(ls "$EOS_CONNECT_LIBS" | wc -l) connect jars, $(ls "$EOS_CONNECT_PLUGIN_PATH/debezium-postgres" | wc -l) debezium jars, $(ls "$EOS_CONNECT_PLUGIN_PATH/debezium-jdbc" | wc -l) jdbc sink jars, the eos-connect plugin, $("$EOS_VENV/bin/python" --version))"
