#!/usr/bin/env bash
# Packs what a device call needs (the GPU machine has no cargo): the release `fmoe` and every test
# binary, stripped of debug info and xz-compressed into .device/NAME/bin.tar.xz (~20 MB: the device
# tool carries at most 64 MiB), and the peers into .peers/. Then run a device call with
# carry [".device/NAME", ".peers"], e.g. `bash scripts/device/full_table.sh NAME`.
#
#   scripts/device/bundle.sh NAME [TEST_TARGET_REGEX]   (default: every test binary)
set -euo pipefail
name=${1:?usage: bundle.sh NAME [TEST_TARGET_REGEX]}
filter=${2:-.}
top=$(git rev-parse --show-toplevel)
cd "$top"
dir=.device/$name
rm -rf "$dir/bin" "$dir/bin.tar.xz"
mkdir -p "$dir/bin/tests" .peers
cargo build --release --quiet
cargo test --release --workspace --no-run --message-format=json 2>/dev/null \
  | jq -r 'select(.executable != null and .profile.test) | [.target.name, .executable] | @tsv' \
  | while IFS=$'\t' read -r target exe; do
      if [[ $target =~ $filter ]]; then cp "$exe" "$dir/bin/tests/$target"; fi
    done
cp target/release/fmoe "$dir/bin/fmoe"
strip --strip-debug "$dir/bin/fmoe"
find "$dir/bin/tests" -type f -exec strip --strip-debug {} +
tar cf - -C "$dir/bin" . | xz -T0 -6 > "$dir/bin.tar.xz"
rm -rf "$dir/bin"
if [ -d ../shared/peers ]; then cp -r ../shared/peers/. .peers/; fi
git rev-parse --short HEAD > "$dir/commit"
echo "$dir/bin.tar.xz: $(du -h "$dir/bin.tar.xz" | cut -f1), commit $(cat "$dir/commit"); carry [\"$dir\", \".peers\"]"
