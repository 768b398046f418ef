# Ray token authentication for the launch scripts (sourced: `. launch/ray_auth.sh head|worker`).
# On by default: RAY_AUTH_MODE=token unless the environment says otherwise (RAY_AUTH_MODE=disabled turns
# it off). The token: RAY_AUTH_TOKEN if set, else the file RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token,
# Ray's own default). The head creates the file (mode 600) when it is missing; a worker without one
# stops with an error: give every node the same file (a shared home or filesystem, or copy it).
# An existing token file that group or others may read or write is refused (Ray's own `ray start` writes
# ~/.ray/auth_token with mode 644): anyone on the machine may already hold that token, so tightening the
# mode would not make it secret again. Execute bits for group or others are cleared (the owner's kept).
# The megagrpo driver started by ray_head.sh inherits the same settings.
_ray_auth_role="${1:?usage: . launch/ray_auth.sh head|worker}"
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ]; then
  export RAY_AUTH_TOKEN_PATH="${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}"
  if [ ! -s "$RAY_AUTH_TOKEN_PATH" ]; then
    if [ "$_ray_auth_role" != head ]; then
      echo "ray_auth: no Ray token at RAY_AUTH_TOKEN_PATH=$RAY_AUTH_TOKEN_PATH; copy the head's token there" \
        "(or set RAY_AUTH_TOKEN), or set RAY_AUTH_MODE=disabled on every node" >&2
      exit 1
    fi
    mkdir -p "$(dirname "$RAY_AUTH_TOKEN_PATH")"
    # Written under a temporary name, mode 600 from the start, then renamed: never readable by others,
    # never half-written.
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH.tmp.$$" &&
      mv -f "$RAY_AUTH_TOKEN_PATH.tmp.$$" "$RAY_AUTH_TOKEN_PATH")
    echo "ray_auth: created a Ray token at $RAY_AUTH_TOKEN_PATH; every node and driver needs this file"
  fi
  _ray_auth_mode="$(stat -L -c %a "$RAY_AUTH_TOKEN_PATH" 2>/dev/null || stat -L -f %Lp "$RAY_AUTH_TOKEN_PATH")"
  if (((8#$_ray_auth_mode & 8#066) != 0)); then
    echo "ray_auth: the Ray token $RAY_AUTH_TOKEN_PATH has mode $_ray_auth_mode: group or others may read" \
      "or replace it, so anyone on this machine may already hold it; refused. Remove it and start the head" \
      "again (it creates a new one, mode 600) and give every node the new file, or, where no one else" \
      "could have read it, chmod 600 $RAY_AUTH_TOKEN_PATH" >&2
    exit 1
  fi
  if (((8#$_ray_auth_mode & 8#077) != 0)); then
    chmod go= "$RAY_AUTH_TOKEN_PATH"
    echo "ray_auth: $RAY_AUTH_TOKEN_PATH had mode $_ray_auth_mode; group and others now have no access"
  fi
  unset _ray_auth_mode
fi
unset _ray_auth_role
