# shellcheck shell=bash
# ./run serve, sourced by run (which provides die, x, need, ensure_venv, ensure_debian,
# data_location, DRY_RUN and the SERVE_* settings of config.sh).

# shellcheck disable=SC2153  # the SERVE_* settings come from config.sh, which run sources first
# nginx serving a shard directory read-only (GET/HEAD, range requests), from SERVE_ROOT/PORT:
# its config, pid file and logs. --stop stops the instances this checkout started, nothing else.
#: serve [DIR] [--port P] [--addr A]  serve a shard directory (default: DATA, else the demo) read-only
#:               over HTTP with nginx (HTTPS with SERVE_CERT/SERVE_KEY) to this machine, or to SERVE_ALLOW's
#:               networks, with SERVE_TOKEN or SERVE_HTPASSWD's credentials; train with --data http://HOST:P/
#: serve --stop [--port P]  stop what ./run serve started (all ports, or P)
cmd_serve() {
  local dir="" port=$SERVE_PORT addr=$SERVE_ADDR addr_from=SERVE_ADDR stop=0 only="" state pidfile pid scheme=http
  while [ $# -gt 0 ]; do
    case $1 in
      --port) port=${2:?--port needs a number} only=$2; shift 2 ;;
      --addr) addr=${2:?--addr needs an address} addr_from=--addr; shift 2 ;;
      --stop) stop=1; shift ;;
      -*) die "serve: unknown option $1 (serve [DIR] [--port P] [--addr A] | serve --stop [--port P])" ;;
      *) dir=$(callers_path "$1"); shift ;;
    esac
  done
  [[ "$port" =~ ^[0-9]+$ ]] || die "serve: --port $port is not a port number"
  if [ "$stop" = 1 ]; then
    local stopped=0
    for pidfile in "$SERVE_ROOT"/*/nginx.pid; do
      [ -f "$pidfile" ] || continue
      [ -z "$only" ] || [ "$pidfile" = "$SERVE_ROOT/$only/nginx.pid" ] || continue
      pid=$(cat "$pidfile")
      if [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = nginx ]; then
        x kill -TERM "$pid"
        [ "$DRY_RUN" = 1 ] || while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
        echo "run: stopped nginx $pid (port $(basename "$(dirname "$pidfile")"))"
        stopped=1
      fi
      x rm -f "$pidfile"
    done
    [ "$stopped" = 1 ] || echo "run: no nginx started by ./run serve is running"
    return 0
  fi
  if [ -z "$dir" ]; then
    ensure_venv requirements.txt
    data_location
    dir=$DATA_AT
  fi
  [[ "$dir" != *://* ]] || die "serve: $dir is not a local directory (serve serves shards on this machine's disk)"
  # a manifest's shards, or another tool's (to index over HTTP: index URL --manifest-to DIR); a
  # dry run's demo was only promised: it has no manifest yet
  local shown=$dir/manifest.json
  [ -f "$shown" ] || shown=$(find "$dir/" -maxdepth 1 -name '*.tar' -print -quit 2>/dev/null) || shown=""
  [ -n "$shown" ] || { [ "$DRY_RUN" = 1 ] && [ "$dir" = "$DEMO_DIR/shards" ]; } \
    || die "serve: $dir has no manifest.json and no .tar shards: give a directory of shards (./run shards convert, or another tool's to index)"
  dir=$(realpath -m "$dir")
  host_only "$addr_from" "$addr"
  [[ "${SERVE_RATE:-0}" =~ ^[0-9]+[kKmM]?$ ]] || die "serve: SERVE_RATE $SERVE_RATE is not a rate: bytes per second, e.g. 100m"
  INSTALL_DEPS=1 ensure_debian "" nginx nginx  # (the verb asked for needs it)
  need nginx "install nginx (Debian/Ubuntu: apt-get install nginx), or serve $dir with any web server that answers range requests"
  state=$(realpath -m "$SERVE_ROOT/$port")
  pid=$(cat "$state/nginx.pid" 2>/dev/null) || pid=""
  if [ -n "$pid" ] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = nginx ]; then
    die "serve: already serving on port $port (nginx $pid): ./run serve --stop --port $port first"
  fi
  local allow=() auth=() user=()
  allowed allow "$addr"
  unprivileged_workers user "$dir" "$(basename "${shown:-manifest.json}")"
  credentials auth
  local listen=("$addr:$port") tls=()
  if [ -n "$SERVE_CERT" ] || [ -n "$SERVE_KEY" ]; then
    [ -f "$SERVE_CERT" ] && [ -f "$SERVE_KEY" ] || die "serve: SERVE_CERT and SERVE_KEY must both name files (PEM certificate and key)"
    scheme=https listen+=(ssl)
    tls=("ssl_certificate $(nginx_word "$(realpath "$SERVE_CERT")");" "ssl_certificate_key $(nginx_word "$(realpath "$SERVE_KEY")");")
  fi
  local path
  for path in "$dir" "$state" "$SERVE_CERT" "$SERVE_KEY" "$SERVE_HTPASSWD"; do  # (nginx reads a $ as a variable's)
    [[ "$path" != *'$'* && "$path" != *[[:cntrl:]]* ]] \
      || die "serve: nginx cannot take the path $(quoted "$path"): rename it without \$ or control characters"
  done
  x mkdir -p "$state/tmp"
  # only what lies in $dir: no link is followed out of it (nor in it; a shard may not be a link)
  local conf
  conf=$(cat <<CONF
${user[*]}
worker_processes auto;
pid $(nginx_word "$state/nginx.pid");
error_log $(nginx_word "$state/error.log") warn;
events { worker_connections 1024; }
http {
  access_log $(nginx_word "$state/access.log");
  client_body_temp_path $(nginx_word "$state/tmp/body");
  proxy_temp_path $(nginx_word "$state/tmp/proxy");
  fastcgi_temp_path $(nginx_word "$state/tmp/fastcgi");
  uwsgi_temp_path $(nginx_word "$state/tmp/uwsgi");
  scgi_temp_path $(nginx_word "$state/tmp/scgi");
  types { application/json json; application/x-tar tar; }
  default_type application/octet-stream;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 10000;
  limit_rate ${SERVE_RATE:-0};
  server {
    listen ${listen[*]};
    ${tls[*]}
    root $(nginx_word "$dir");
    disable_symlinks on from=\$document_root;
    autoindex off;
    ${allow[*]}
    location / {
      limit_except GET { deny all; }
      ${auth[*]}
    }
  }
}
CONF
)
  if [ "$DRY_RUN" = 1 ]; then
    # shellcheck disable=SC2016  # the variable's name, not its value: a dry run prints no secret
    [ -z "$SERVE_TOKEN" ] || conf=${conf//"$SERVE_TOKEN"/'$SERVE_TOKEN'}
    printf "cat >%q <<'CONF'\n%s\nCONF\n" "$state/nginx.conf" "$conf"
  else
    (umask 077 && echo "$conf" >"$state/nginx.conf")  # (it may hold SERVE_TOKEN)
  fi
  x nginx -p "$state" -e "$state/error.log" -c "$state/nginx.conf" \
    || die "serve: nginx did not start on $addr:$port (see above and $state/error.log)"
  [ "$DRY_RUN" = 1 ] || echo "run: serving $dir read-only at $scheme://$addr:$port/ (log: $state/access.log; stop: ./run serve --stop --port $port)"
}

# nginx's allow/deny lines (into the array named $1) for who may read what binds $2: SERVE_ALLOW's
# CIDRs, everyone for "all"; empty (config.sh's default), this machine alone, which is all a
# loopback address serves.
allowed() {
  local -n allow_lines=$1
  local addr=$2 cidr
  if [ "$SERVE_ALLOW" = all ]; then
    return
  fi
  if [ -z "$SERVE_ALLOW" ]; then
    [[ "$addr" == 127.* || "$addr" == localhost || "$addr" == "[::1]" ]] \
      || die "serve: --addr $addr serves other machines: name who may read in SERVE_ALLOW (CIDRs, e.g. SERVE_ALLOW=10.0.0.0/8), or SERVE_ALLOW=all"
    allow_lines=("allow 127.0.0.0/8;" "allow ::1;" "deny all;")
    return
  fi
  for cidr in ${SERVE_ALLOW//,/ }; do
    [[ "$cidr" =~ ^[0-9a-fA-F.:]+(/[0-9]{1,3})?$ ]] || die "serve: SERVE_ALLOW: $cidr is not an address or CIDR (e.g. 10.0.0.0/8)"
    allow_lines+=("allow $cidr;")
  done
  [ ${#allow_lines[@]} -gt 0 ] \
    || die "serve: SERVE_ALLOW '$SERVE_ALLOW' names no one: give CIDRs (e.g. 10.0.0.0/8), or all, or leave it empty for this machine alone"
  allow_lines+=("deny all;")
}

# Refuses an address ($2, given as $1) that is more than a host: IPv4, [IPv6] or a name (the port
# is --port's). It goes into nginx.conf as it is.
host_only() {
  local from=$1 addr=$2 octet
  if [[ "$addr" =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    for octet in ${addr//./ }; do [ "${#octet}" -le 3 ] && [ "$((10#$octet))" -le 255 ] || addr=""; done
  fi
  [[ "$addr" =~ ^\[[0-9A-Fa-f.]*:[0-9A-Fa-f:.]*\]$ || "$addr" =~ ^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$ ]] \
    || die "serve: $from $(quoted "$2") is not a host: give an IPv4 address, an [IPv6] one or a name, without a port (--port or SERVE_PORT gives it)"
}

# As root, nginx's workers run as nobody (a root worker reads whatever it is asked for): the line
# saying so, into the array named $1; nobody must be able to read DIR ($2)'s file $3. Otherwise
# they run as the caller, as nginx itself has it.
unprivileged_workers() {
  local -n user_line=$1
  local dir=$2 file=$3
  [ "$(id -u)" = 0 ] || return 0
  id nobody >/dev/null 2>&1 \
    || die "serve: there is no user nobody for nginx's workers (they never run as root): create it (useradd --system nobody)"
  readable_by_workers "$dir/$file" \
    || die "serve: nginx's workers run as nobody, who cannot read $dir/$file: let others into $dir and the folders above it (chmod o+x) and read its files (chmod o+r), or serve it as its owner"
  # shellcheck disable=SC2034  # (a nameref: the caller's array)
  user_line=("user nobody $(id -gn nobody);")
}

# Whether nginx's workers (workers_name: as root nobody, else the caller) may read the file $1;
# a dry run runs nothing, so yes.
readable_by_workers() {
  [ "$DRY_RUN" = 0 ] || return 0
  [ "$(id -u)" = 0 ] || { [ -r "$1" ]; return; }
  setpriv --reuid "$(id -u nobody)" --regid "$(id -g nobody)" --clear-groups test -r "$1"
}
workers_name() { if [ "$(id -u)" = 0 ]; then echo nobody; else id -un; fi; }

# $1 as one word of nginx.conf: plain where that is safe, else in double quotes (a space ended it).
nginx_word() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:@%+,=-]+$ ]]; then
    echo "$1"
  else
    local word=${1//\\/\\\\}
    echo "\"${word//\"/\\\"}\""
  fi
}

# nginx's lines (into the array named $1) that ask for SERVE_TOKEN (a bearer token) or the
# users of SERVE_HTPASSWD (basic auth); none where neither is set.
credentials() {
  local -n auth_lines=$1
  [ -z "$SERVE_TOKEN" ] || [ -z "$SERVE_HTPASSWD" ] || die "serve: give SERVE_TOKEN or SERVE_HTPASSWD, not both"
  if [ -n "$SERVE_TOKEN" ]; then
    [[ "$SERVE_TOKEN" =~ ^[A-Za-z0-9._~+/=-]{16,}$ ]] \
      || die "serve: SERVE_TOKEN must be 16 or more of A-Z a-z 0-9 . _ ~ + / = - (e.g. \$(openssl rand -hex 24))"
    auth_lines=("if (\$http_authorization != \"Bearer $SERVE_TOKEN\") { return 401; }")
  elif [ -n "$SERVE_HTPASSWD" ]; then
    [ -f "$SERVE_HTPASSWD" ] || die "serve: SERVE_HTPASSWD $SERVE_HTPASSWD is not a file (make one with htpasswd)"
    local users
    users=$(realpath "$SERVE_HTPASSWD")
    # (nginx's workers read it at each request: one they cannot read answers 500)
    readable_by_workers "$users" \
      || die "serve: nginx's workers ($(workers_name)) cannot read SERVE_HTPASSWD $SERVE_HTPASSWD: let them (chmod o+r, or chgrp to their group and chmod g+r)"
    # shellcheck disable=SC2034  # (a nameref: the caller's array)
    auth_lines=("auth_basic shards;" "auth_basic_user_file $(nginx_word "$users");")
  fi
}
