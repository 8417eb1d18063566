//! Nothing lost, nothing crashes: terminal output that fails, one writer per run dir, torn
//! records, checkpoint leftovers, non-finite checkpoints, untrusted caches, hostile paths.
//! Each test drives the real binary the way a user (or an accident) would.

use std::fs::{self, File, OpenOptions};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_cockpit"))
}

fn cockpit() -> Command {
    let mut c = Command::new(bin());
    c.env("NO_COLOR", "1").stdin(Stdio::null());
    c
}

/// A short CPU run's arguments: `steps` steps, small evals, a checkpoint every `every` steps.
fn short_run(run: &Path, steps: u32, every: u32) -> Vec<String> {
    vec![
        "train".into(),
        "--no-tui".into(),
        "--device".into(),
        "cpu".into(),
        "--max-steps".into(),
        steps.to_string(),
        "--run-dir".into(),
        run.display().to_string(),
        "--set".into(),
        "eval.batches=1".into(),
        "--set".into(),
        format!("eval.every={every}"),
        "--set".into(),
        format!("checkpoint.every_steps={every}"),
    ]
}

fn dev_full() -> Option<File> {
    OpenOptions::new().write(true).open("/dev/full").ok()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn metrics(run: &Path) -> String {
    fs::read_to_string(run.join("metrics.jsonl")).unwrap_or_default()
}

/// Class 1: stderr on a full device: the run completes, checkpoints, records its end, and
/// says once in its log that the terminal went away.
#[test]
fn training_with_stderr_on_a_full_device_completes() {
    let Some(full) = dev_full() else {
        eprintln!("skipped: no /dev/full here");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let status = cockpit()
        .args(short_run(&run, 4, 2))
        .stdout(full.try_clone().unwrap())
        .stderr(full)
        .status()
        .unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(run.join("checkpoints/latest").is_file());
    let m = metrics(&run);
    assert!(m.contains("\"event\":\"finished\""), "{m}");
    let log = fs::read_to_string(run.join("cockpit.log")).unwrap();
    assert_eq!(log.matches("stderr went away").count(), 1, "{log}");
}

/// Class 1: read-only commands whose reader went away (`| head`, `| true`) or whose output
/// goes to a full device exit without a panic.
#[test]
fn commands_into_a_closed_pipe_or_a_full_device_do_not_panic() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let o = cockpit().args(short_run(&run, 2, 2)).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let export = dir.path().join("export");
    let cases: Vec<Vec<String>> = vec![
        vec!["check".into()],
        vec!["--help".into()],
        vec!["plot".into(), run.display().to_string()],
        vec![
            "compare".into(),
            run.display().to_string(),
            "--out".into(),
            dir.path().join("cmp").display().to_string(),
        ],
        vec![
            "export".into(),
            run.display().to_string(),
            export.display().to_string(),
        ],
        vec![
            "generate".into(),
            run.display().to_string(),
            "--prompt".into(),
            "ab".into(),
            "--max-tokens".into(),
            "4".into(),
        ],
    ];
    for args in &cases {
        // a reader that is gone before the first write: EPIPE on every write
        let mut child = cockpit()
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_ne!(o.status.code(), Some(101), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let _ = fs::remove_dir_all(&export);
        if let Some(full) = dev_full() {
            let o = cockpit()
                .args(args)
                .stdout(full.try_clone().unwrap())
                .stderr(full)
                .status()
                .unwrap();
            assert_ne!(o.code(), Some(101), "{args:?} to /dev/full");
            assert!(o.code().is_some(), "{args:?}: killed by a signal");
        }
        let _ = fs::remove_dir_all(&export);
    }
}

/// Poll `f` until it holds, for at most a generous deadline.
fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A child process killed (SIGKILL) when dropped, so a failing test leaves no run behind.
struct Killed(std::process::Child);

impl Killed {
    fn kill(&mut self) {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(self.0.id() as i32, libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Class 2: a run dir has one writer. While run A trains in D, a second fresh run and a
/// `--resume latest` into D are refused with exit 2 naming A's PID and host; after A dies
/// (kill -9: the OS drops its lock) a fresh run into D is refused until `--fresh`, which
/// archives A's records instead of mixing them.
#[test]
fn a_run_dir_has_one_writer_and_old_records_are_archived_not_mixed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let mut a = Killed(
        cockpit()
            .args(short_run(&run, 100_000, 2))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("run A's first checkpoint", || {
        run.join("checkpoints/latest").is_file()
    });
    let holder = format!("PID {}", a.0.id());
    for extra in [&[][..], &["--resume", "latest"][..], &["--fresh"][..]] {
        let o = cockpit()
            .args(short_run(&run, 4, 2))
            .args(extra)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{extra:?}: {err}");
        assert!(
            err.contains(&holder) && err.contains("on host"),
            "{extra:?}: {err}"
        );
    }
    a.kill();
    let before = metrics(&run);
    let o = cockpit().args(short_run(&run, 2, 2)).output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--fresh") && err.contains("--resume"), "{err}");
    assert_eq!(metrics(&run), before, "a refused run writes nothing");
    let o = cockpit()
        .args(short_run(&run, 2, 2))
        .arg("--fresh")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let archived: Vec<PathBuf> = fs::read_dir(run.join("archive"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(archived.len(), 1);
    assert!(fs::read_to_string(archived[0].join("metrics.jsonl"))
        .unwrap()
        .starts_with(&before));
    let m = metrics(&run);
    assert_eq!(m.matches("\"run_started\"").count(), 1, "{m}");
}

/// Class 3: records are whole or absent. A torn last record (a crash or a full disk
/// mid-write) is cut, and reported, before a resumed run appends; every line then decodes
/// and `plot` reads the file.
#[test]
fn a_resume_cuts_a_torn_last_record_before_appending() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let o = cockpit().args(short_run(&run, 2, 2)).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let mut f = OpenOptions::new()
        .append(true)
        .open(run.join("metrics.jsonl"))
        .unwrap();
    std::io::Write::write_all(&mut f, br#"{"event":"step","step":3,"lo"#).unwrap();
    drop(f);
    let o = cockpit()
        .args(short_run(&run, 4, 2))
        .args(["--resume", "latest"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let m = metrics(&run);
    assert!(m.ends_with('\n'));
    for (i, line) in m.lines().enumerate() {
        assert!(
            serde_json::from_str::<serde_json::Value>(line).is_ok(),
            "line {}: {line}",
            i + 1
        );
    }
    assert!(m.contains("cut a torn last record"), "{m}");
    let o = cockpit()
        .arg("plot")
        .arg(&run)
        .stdout(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

/// Class 5 and 7: a learning rate or λ outside any sane range, and sizes that could only
/// exhaust memory, are config errors naming the key; a checkpoint holding NaN weights (written
/// before saves were checked) is refused, never restored.
#[test]
fn insane_values_are_config_errors_and_a_nan_checkpoint_is_never_restored() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    for (set, key) in [
        ("optim.lr=1e300", "optim.lr"),
        ("scu.lambda_max=1e300", "scu.lambda_max"),
        ("data.builtin_tokens=1000000000000", "data.builtin_tokens"),
        ("lora.r=1000000000000", "lora.r"),
    ] {
        let o = cockpit()
            .args(short_run(&run, 2, 2))
            .args(["--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{set}: {err}");
        assert!(err.contains(key), "{set}: {err}");
    }
    assert!(!run.join("metrics.jsonl").exists(), "nothing was written");
    let o = cockpit().args(short_run(&run, 2, 2)).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    // poison the checkpoint as a diverged run of an older build would have saved it
    let step = run.join("checkpoints/step-00000002");
    let model = step.join("model.safetensors");
    let dev = candle_core::Device::Cpu;
    let mut tensors = candle_core::safetensors::load(&model, &dev).unwrap();
    let (name, t) = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.clone()))
        .next()
        .unwrap();
    let nan = (t.ones_like().unwrap() * f64::NAN).unwrap();
    tensors.insert(name, nan);
    candle_core::safetensors::save(&tensors, &model).unwrap();
    let bytes = fs::read(&model).unwrap();
    let mpath = step.join("manifest.json");
    let mut manifest: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&mpath).unwrap()).unwrap();
    for f in manifest["files"].as_array_mut().unwrap() {
        if f["name"] == "model.safetensors" {
            f["bytes"] = bytes.len().into();
            f["sha256"] = sha256_hex(&bytes).into();
        }
    }
    fs::write(&mpath, serde_json::to_vec(&manifest).unwrap()).unwrap();
    let o = cockpit()
        .args(short_run(&run, 4, 2))
        .args(["--resume", "latest"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("non-finite"), "{err}");
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Class 7: a config path or a checkpoint's `latest` that is a FIFO is refused at once
/// (exit 2 naming it), not a process blocked forever.
#[test]
fn a_fifo_for_a_config_or_latest_is_refused_not_a_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("config.toml");
    let c = std::ffi::CString::new(fifo.display().to_string()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let o = cockpit()
        .args(["train", "--no-tui"])
        .arg(&fifo)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("config.toml") && err.contains("regular file"),
        "{err}"
    );
    let run = dir.path().join("run");
    fs::create_dir_all(run.join("checkpoints")).unwrap();
    let latest =
        std::ffi::CString::new(run.join("checkpoints/latest").display().to_string()).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(latest.as_ptr(), 0o600) }, 0);
    let o = cockpit()
        .args(short_run(&run, 2, 2))
        .args(["--resume", "latest"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("latest") && err.contains("regular file"),
        "{err}"
    );
}

/// A files corpus of about 40 KB and a config that trains a tiny model on it.
fn files_corpus(dir: &Path) -> (PathBuf, PathBuf) {
    let text = dir.join("text");
    fs::create_dir_all(&text).unwrap();
    let body = "the quick brown fox jumps over the lazy dog. ".repeat(900);
    fs::write(text.join("a.txt"), body).unwrap();
    let cfg = dir.join("files.toml");
    fs::write(
        &cfg,
        "[data]\nsource = \"files\"\ntrain = \"text\"\nval_fraction = 0.1\n\
         [model]\nn_embd = 16\nn_layer = 1\nn_head = 2\nseq_len = 32\n[optim]\nmicro_batch = 4\n\
         [schedule]\nwarmup_steps = 0\n[eval]\nevery = 2\nbatches = 1\n[monitor]\nenabled = false\n",
    )
    .unwrap();
    let shard = fs::read_dir(text.join(".cockpit-cache"))
        .ok()
        .and_then(|mut d| d.find(|e| e.as_ref().is_ok_and(|e| e.path().is_dir())))
        .map(|e| e.unwrap().path().join("train.bin"));
    (cfg, shard.unwrap_or_default())
}

/// The cache's train.bin, once `cockpit prepare` has written it.
fn prepared_shard(dir: &Path, cfg: &Path) -> PathBuf {
    let o = cockpit().arg("prepare").arg(cfg).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let (_, shard) = files_corpus(dir);
    assert!(shard.is_file(), "{}", shard.display());
    shard
}

/// Class 6: token caches are verified at open. A cache truncated to half, or overwritten
/// with random bytes of the same size, is rebuilt from the sources (and the rebuild said),
/// not trained on; the run then sees every token.
#[test]
fn a_truncated_or_overwritten_cache_is_rebuilt_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = files_corpus(dir.path());
    let shard = prepared_shard(dir.path(), &cfg);
    let good = fs::read(&shard).unwrap();
    let mut random = vec![0u8; good.len()];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in &mut random {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    for (case, bytes, why) in [
        (
            "truncated",
            &good[..good.len() / 2],
            "bytes; its manifest says",
        ),
        ("random bytes", &random[..], "content changed"),
    ] {
        fs::write(&shard, bytes).unwrap();
        let run = dir.path().join(format!("run-{}", case.replace(' ', "-")));
        let o = cockpit()
            .args(["train", "--no-tui", "--device", "cpu", "--max-steps", "2"])
            .arg("--run-dir")
            .arg(&run)
            .arg(&cfg)
            .output()
            .unwrap();
        let all = text(&o);
        assert!(o.status.success(), "{case}: {all}");
        assert!(
            all.contains("token cache rebuilt") && all.contains(why),
            "{case}: {all}"
        );
        assert_eq!(fs::read(&shard).unwrap(), good, "{case}: rebuilt as it was");
    }
}

/// Class 6: a cache that shrinks under a running job ends it with exit 2 and an error naming
/// the cache file: not SIGBUS (windows are read by position, never through a memory map).
#[test]
fn a_cache_that_shrinks_during_a_run_is_a_named_error_not_sigbus() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, _) = files_corpus(dir.path());
    let shard = prepared_shard(dir.path(), &cfg);
    let run = dir.path().join("run");
    let mut child = Killed(
        cockpit()
            .args([
                "train",
                "--no-tui",
                "--device",
                "cpu",
                "--max-steps",
                "1000000",
            ])
            .arg("--run-dir")
            .arg(&run)
            .arg(&cfg)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    wait_for("the run's first steps", || {
        metrics(&run).contains("\"event\":\"step\"")
    });
    File::options()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(0)
        .unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().unwrap(), &mut err).unwrap();
    let status = child.0.wait().unwrap();
    assert_eq!(status.code(), Some(2), "{status:?}: {err}");
    assert!(
        err.contains("train.bin") && err.contains("changed while in use"),
        "{err}"
    );
}

/// Whether process `pid` has ended (gone, or a zombie nobody reaped yet).
fn ended(pid: u32) -> bool {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // "pid (comm) S ...": the state follows the last ')'
        Ok(s) => s
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// The children of `pid` (every thread's).
fn children(pid: u32) -> Vec<u32> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    tasks
        .filter_map(|t| fs::read_to_string(t.ok()?.path().join("children")).ok())
        .flat_map(|s| {
            s.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// `--gpus N`: the launcher's header names the backend it resolved ("tcp" on the CPU, not
/// "auto"); a launcher killed with SIGKILL leaves no worker behind (each gets the kernel's
/// parent-death signal and stops).
#[test]
fn workers_of_a_killed_launcher_do_not_outlive_it() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let mut launcher = Killed(
        cockpit()
            .args(["train", "--gpus", "2", "--no-tui", "--device", "cpu"])
            .args([
                "--max-steps",
                "1000000",
                "--set",
                "data.builtin_tokens=100000",
            ])
            .args(["--set", "model.n_layer=1"])
            .args(["--set", &format!("distributed.master_port={port}")])
            .arg("--run-dir")
            .arg(&run)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut stderr = launcher.0.stderr.take().unwrap();
    let header = std::thread::spawn(move || {
        let mut all = Vec::new();
        let _ = std::io::Read::read_to_end(&mut stderr, &mut all);
        String::from_utf8_lossy(&all).into_owned()
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    while !metrics(&run).contains("\"event\":\"step\"") {
        let logs = || {
            (0..2)
                .map(|r| {
                    fs::read_to_string(run.join(format!("ranks/rank-{r}.log"))).unwrap_or_default()
                })
                .collect::<Vec<_>>()
                .join("\n---\n")
        };
        assert!(
            Instant::now() < deadline,
            "no step in 120s; the ranks' logs:\n{}",
            logs()
        );
        assert!(
            launcher.0.try_wait().unwrap().is_none(),
            "the launcher ended: {}",
            logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let workers = children(launcher.0.id());
    assert_eq!(workers.len(), 2, "{workers:?}");
    launcher.kill();
    for pid in &workers {
        wait_for(&format!("worker {pid} to end"), || ended(*pid));
    }
    let header = header.join().unwrap();
    assert!(header.contains("2 workers (tcp backend"), "{header}");
}

/// A LoRA rank above the adapted layers' widths is a config error naming lora.r and the
/// bound, not a giant allocation.
#[test]
fn a_lora_rank_wider_than_the_model_is_a_config_error() {
    let dir = tempfile::tempdir().unwrap();
    let o = cockpit()
        .args(short_run(&dir.path().join("run"), 2, 2))
        .args([
            "--set",
            "lora.enabled=true",
            "--set",
            "lora.base=\"random\"",
        ])
        .args(["--set", "lora.r=100"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("lora.r = 100") && err.contains("at most 64"),
        "{err}"
    );
}

/// An attach that the file system denies (the run is another user's) says so, naming the
/// run dir's owner, instead of calling the socket missing. (Needs root, to be another user.)
#[test]
fn a_denied_attach_is_not_reported_as_a_missing_socket() {
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to attach as another user");
        return;
    }
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let run = dir.path().join("run");
    let _training = Killed(
        cockpit()
            .args(short_run(&run, 1_000_000, 1000))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for("the control socket", || {
        run.join("control.sock").exists() || run.join(".control/control.sock").exists()
    });
    let o = cockpit()
        .args(["attach", "--no-tui"])
        .arg(&run)
        .uid(65534)
        .gid(65534)
        .output();
    let Ok(o) = o else {
        eprintln!("skipped: cannot run the binary as uid 65534");
        return;
    };
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.to_lowercase().contains("permission denied")
            && err.contains("uid 0")
            && !err.contains("missing"),
        "{err}"
    );
}

/// With `--max-steps`, a config that is wrong for another reason reports only that reason:
/// not also a warm-up longer than the run, which `--max-steps` scales away on its own.
#[test]
fn a_config_error_with_max_steps_names_only_the_real_problem() {
    let dir = tempfile::tempdir().unwrap();
    let o = cockpit()
        .args(["train", "--no-tui", "--max-steps", "2", "--run-dir"])
        .arg(dir.path().join("run"))
        .args(["--set", "run.device=tpu"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--set run.device=tpu: run.device"), "{err}");
    assert!(!err.contains("warmup_steps"), "{err}");
}
