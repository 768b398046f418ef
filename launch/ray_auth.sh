# Ray token authentication for the launch scripts (sourced: `. launch/ray_auth.sh head|worker`).
# On by default: RAY_AUTH_MODE=token unless the environment says otherwise (RAY_AUTH_MODE=disabled turns
# it off). The token: RAY_AUTH_TOKEN if set, else the file RAY_AUTH_TOKEN_PATH (default ~/.ray/auth_token,
# Ray's own default). The head creates the file (mode 600) when it is missing; a worker without one
# stops with an error: give every node the same file (a shared home or filesystem, or copy it).
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
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \n' >"$RAY_AUTH_TOKEN_PATH")
    echo "ray_auth: created a Ray token at $RAY_AUTH_TOKEN_PATH; every node and driver needs this file"
  fi
fi
unset _ray_auth_role
