#!/usr/bin/env bash
# Boots real systemd as PID 1 of new pid/mount/uts/ipc/cgroup namespaces, in a throwaway root: an
# overlay of this machine's / whose writes land in tmpfs, so nothing systemd does at boot (it
# cleans /tmp, writes /var, /etc) reaches the host; /proc/sys and /sys are read-only and the units
# that touch the kernel (modules, binfmt, sysctl, udev, swap) are masked. The project's unit files
# are installed as docs/operating.md says, with one node instance enabled under rollart.target.
# Run by tests/integration/test_systemd.py as:
#   unshare --pid --fork --mount --uts --ipc --cgroup --mount-proc systemd_container.sh \
#       REPO VENV CONFIG_DIR SCRATCH NODE
# REPO: the checkout (seen as /opt/rollart); VENV: a venv made from a Python outside /root and
# /home (seen as /opt/rollart/.venv; the unit's ProtectHome hides home folders); CONFIG_DIR: the
# topology.yaml and rollart.env; SCRATCH: an empty folder for the overlay.
set -euo pipefail
repo="$1" venv="$2" config="$3" scratch="$4" node="$5"

mount --make-rprivate /
mount -t tmpfs tmpfs "$scratch"
mkdir -p "$scratch/upper" "$scratch/work" "$scratch/root"
root="$scratch/root"
mount -t overlay overlay -o "lowerdir=/,upperdir=$scratch/upper,workdir=$scratch/work" "$root"
mount -t proc proc "$root/proc"
mount --bind "$root/proc/sys" "$root/proc/sys"
mount -o remount,bind,ro "$root/proc/sys"
mount --rbind /dev "$root/dev"
mount --bind /sys "$root/sys"
mount -o remount,bind,ro "$root/sys"
mount -t cgroup2 cgroup2 "$root/sys/fs/cgroup"
for dir in run tmp var/tmp; do mount -t tmpfs tmpfs "$root/$dir"; done
mkdir -p "$root/opt/rollart"
mount --bind "$repo" "$root/opt/rollart"
mount --bind "$venv" "$root/opt/rollart/.venv"
install -m 0644 "$config/topology.yaml" "$config/rollart.env" "$root/tmp/"

# Units of this machine's boot that would act on the kernel or devices shared with the host.
masked=(systemd-modules-load.service kmod-static-nodes.service systemd-binfmt.service
    proc-sys-fs-binfmt_misc.automount systemd-sysctl.service systemd-udevd.service
    systemd-udev-trigger.service systemd-udev-settle.service systemd-remount-fs.service swap.target
    systemd-firstboot.service systemd-repart.service systemd-random-seed.service
    sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount sys-fs-fuse-connections.mount
    dev-hugepages.mount dev-mqueue.mount)

# The install steps of docs/operating.md, "Under systemd", inside the throwaway root.
chroot "$root" /bin/bash -euo pipefail -c "
    find /etc/systemd/system -mindepth 1 -delete   # this machine's enabled units stay out of the boot
    for unit in ${masked[*]}; do ln -s /dev/null /etc/systemd/system/\$unit; done
    useradd --system --home-dir /var/lib/rollart --no-create-home --shell /usr/sbin/nologin rollart
    install -d -m 0750 -o root -g rollart /etc/rollart
    install -m 0640 -o root -g rollart /tmp/topology.yaml /etc/rollart/topology.yaml
    install -m 0600 -o root -g root /tmp/rollart.env /etc/rollart/rollart.env
    rm /tmp/topology.yaml /tmp/rollart.env
    install -m 0644 /opt/rollart/deploy/systemd/rollart-node@.service /opt/rollart/deploy/systemd/rollart.target \
        /etc/systemd/system/
    mkdir /etc/systemd/system/rollart.target.wants   # what systemctl enable rollart-node@$node makes
    ln -s ../rollart-node@.service /etc/systemd/system/rollart.target.wants/rollart-node@$node.service
"
hostname rollart-systemd-test
exec chroot "$root" /usr/bin/env container=rollart-test /lib/systemd/systemd --unit=rollart.target
