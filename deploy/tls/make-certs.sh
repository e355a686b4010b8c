#!/bin/sh
# Makes a CA and certificates for a test fleet, with openssl (README "Security").
#
#   make-certs.sh DIR ca [NAME]                 DIR/ca.pem, DIR/ca.key: a new CA
#   make-certs.sh DIR server NAME SAN[,SAN...]  DIR/NAME.pem, .key: a node's certificate,
#                                               e.g. server node-a DNS:node-a.example,IP:10.0.0.5
#                                               (also a client one: a node presents it to
#                                               its peers)
#   make-certs.sh DIR client HOST               DIR/HOST.pem, .key: an agent's certificate; the
#                                               node lets it speak for host HOST only
#   make-certs.sh DIR expired-client HOST       the same, expired in 2020 (for tests)
#
# Certificates are signed by DIR/ca.pem and valid 825 days; keys are P-256.
# Production fleets usually have a CA already: any certificate with the same
# fields works (a node's names in subjectAltName; an agent's host name as a DNS
# subjectAltName, extendedKeyUsage clientAuth).
set -eu
[ $# -ge 2 ] || { sed -n '2,16p' "$0"; exit 2; }
dir=$1 cmd=$2
shift 2
mkdir -p "$dir"
cd "$dir"

key() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
  chmod 600 "$1.key"
}

sign() { # name usage san dates...
  name=$1 usage=$2 san=$3
  shift 3
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=%s\nsubjectAltName=%s\n' \
    "$usage" "$san" > "$name.ext"
  openssl ca -batch -config ca.cnf -cert ca.pem -keyfile ca.key -notext \
    -in "$name.csr" -out "$name.pem" -extfile "$name.ext" "$@" 2>/dev/null
  rm -f "$name.csr" "$name.ext"
  echo "$dir/$name.pem"
}

case $cmd in
ca)
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout ca.key -out ca.pem -days 3650 -subj "/CN=${1:-gpulse test CA}" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
  chmod 600 ca.key
  mkdir -p issued
  : > index.txt
  echo 1000 > serial
  cat > ca.cnf <<'CNF'
[ca]
default_ca = gpulse
[gpulse]
dir = .
database = index.txt
new_certs_dir = issued
serial = serial
default_md = sha256
default_days = 825
policy = any
unique_subject = no
[any]
commonName = supplied
CNF
  echo "$dir/ca.pem"
  ;;
server)
  [ $# -eq 2 ] || { echo "usage: $0 DIR server NAME SAN[,SAN...]" >&2; exit 2; }
  key "$1"
  sign "$1" serverAuth,clientAuth "$2"
  ;;
client)
  [ $# -eq 1 ] || { echo "usage: $0 DIR client HOST" >&2; exit 2; }
  key "$1"
  sign "$1" clientAuth "DNS:$1"
  ;;
expired-client)
  [ $# -eq 1 ] || { echo "usage: $0 DIR expired-client HOST" >&2; exit 2; }
  key "$1"
  sign "$1" clientAuth "DNS:$1" -startdate 20200101000000Z -enddate 20200102000000Z
  ;;
*)
  echo "unknown command $cmd" >&2
  exit 2
  ;;
esac
