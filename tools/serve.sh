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
  local dir="" port=$SERVE_PORT addr=$SERVE_ADDR stop=0 only="" state pidfile pid scheme=http
  while [ $# -gt 0 ]; do
    case $1 in
      --port) port=${2:?--port needs a number} only=$2; shift 2 ;;
      --addr) addr=${2:?--addr needs an address}; shift 2 ;;
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
  # (a dry run's demo was only promised: it has no manifest yet)
  [ -f "$dir/manifest.json" ] || { [ "$DRY_RUN" = 1 ] && [ "$dir" = "$DEMO_DIR/shards" ]; } \
    || die "serve: $dir has no manifest.json: give a directory of converted shards (./run shards convert)"
  dir=$(realpath -m "$dir")
  INSTALL_DEPS=1 ensure_debian "" nginx nginx  # (the verb asked for needs it)
  need nginx "install nginx (Debian/Ubuntu: apt-get install nginx), or serve $dir with any web server that answers range requests"
  state=$(realpath -m "$SERVE_ROOT/$port")
  pid=$(cat "$state/nginx.pid" 2>/dev/null) || pid=""
  if [ -n "$pid" ] && [ "$(ps -o comm= -p "$pid" 2>/dev/null)" = nginx ]; then
    die "serve: already serving on port $port (nginx $pid): ./run serve --stop --port $port first"
  fi
  local allow=() auth=()
  allowed allow "$addr"
  credentials auth
  local listen=("$addr:$port") tls=()
  if [ -n "$SERVE_CERT" ] || [ -n "$SERVE_KEY" ]; then
    [ -f "$SERVE_CERT" ] && [ -f "$SERVE_KEY" ] || die "serve: SERVE_CERT and SERVE_KEY must both name files (PEM certificate and key)"
    scheme=https listen+=(ssl)
    tls=("ssl_certificate $(realpath "$SERVE_CERT");" "ssl_certificate_key $(realpath "$SERVE_KEY");")
  fi
  x mkdir -p "$state/tmp"
  # as root, workers run as this user (they only read $dir); otherwise nginx cannot switch user
  local conf
  conf=$(cat <<CONF
$( [ "$(id -u)" != 0 ] || echo "user $(id -un) $(id -gn);" )
worker_processes auto;
pid $state/nginx.pid;
error_log $state/error.log warn;
events { worker_connections 1024; }
http {
  access_log $state/access.log;
  client_body_temp_path $state/tmp/body;
  proxy_temp_path $state/tmp/proxy;
  fastcgi_temp_path $state/tmp/fastcgi;
  uwsgi_temp_path $state/tmp/uwsgi;
  scgi_temp_path $state/tmp/scgi;
  types { application/json json; application/x-tar tar; }
  default_type application/octet-stream;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 10000;
  limit_rate ${SERVE_RATE:-0};
  server {
    listen ${listen[*]};
    ${tls[*]}
    root $dir;
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
# CIDRs, everyone for "all"; unset, this machine alone, which is all a loopback address serves.
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
  allow_lines+=("deny all;")
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
    [ -r "$SERVE_HTPASSWD" ] || die "serve: SERVE_HTPASSWD $SERVE_HTPASSWD is not a readable file (make it with htpasswd)"
    # shellcheck disable=SC2034  # (a nameref: the caller's array)
    auth_lines=("auth_basic shards;" "auth_basic_user_file $(realpath "$SERVE_HTPASSWD");")
  fi
}
