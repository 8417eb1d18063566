//! Class 10: hostile input, a bounded sweep run in CI. Bad configs, bad data, truncated and
//! overwritten caches and checkpoints, FIFOs and devices where files belong, output to a full
//! device or a closed pipe — each case runs the real (debug) binary, two at a time, and must
//! end on its own (no hang), without a panic (exit 101, "panicked") or a signal (an abort);
//! bad input ends with exit 2 and the offending file, key or value named.

use std::ffi::OsString;
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A case that has not ended by then hangs.
const HANG: Duration = Duration::from_secs(90);

#[derive(Clone, Copy, PartialEq)]
enum Out {
    /// Captured (and checked for a panic message).
    Captured,
    /// `/dev/full`: every write fails with ENOSPC.
    Full,
    /// A pipe whose reader is gone before the first write: EPIPE.
    Closed,
}

#[derive(Clone, Copy)]
enum Expect {
    /// Exit 2, stderr naming each of these.
    Usage(&'static [&'static str]),
    /// Exit 0, the output holding each of these.
    Success(&'static [&'static str]),
    /// Any exit of its own (not 101, not a signal).
    Survives,
}

struct Case {
    name: String,
    args: Vec<OsString>,
    stdout: Out,
    stderr: Out,
    expect: Expect,
}

fn case(name: &str, args: &[&dyn AsRef<std::ffi::OsStr>], expect: Expect) -> Case {
    Case {
        name: name.into(),
        args: args.iter().map(|a| a.as_ref().to_os_string()).collect(),
        stdout: Out::Captured,
        stderr: Out::Captured,
        expect,
    }
}

impl Case {
    fn out(mut self, stdout: Out, stderr: Out) -> Self {
        self.stdout = stdout;
        self.stderr = stderr;
        self
    }
}

fn stdio(out: Out) -> Stdio {
    match out {
        Out::Captured | Out::Closed => Stdio::piped(),
        Out::Full => OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .map(Stdio::from)
            .unwrap_or_else(|_| Stdio::null()),
    }
}

/// Drain a captured stream on a thread (a full pipe would block the child).
fn drain(r: Option<impl Read + Send + 'static>) -> Option<std::thread::JoinHandle<String>> {
    r.map(|mut r| {
        std::thread::spawn(move || {
            let mut s = Vec::new();
            let _ = r.read_to_end(&mut s);
            String::from_utf8_lossy(&s).into_owned()
        })
    })
}

/// Run one case: its exit code, or what went wrong.
fn run(c: &Case) -> Result<i32, String> {
    let mut child: Child = Command::new(env!("CARGO_BIN_EXE_cockpit"))
        .args(&c.args)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(stdio(c.stdout))
        .stderr(stdio(c.stderr))
        .spawn()
        .map_err(|e| format!("cannot start: {e}"))?;
    let (mut out, mut err) = (child.stdout.take(), child.stderr.take());
    if c.stdout == Out::Closed {
        out = None;
    }
    if c.stderr == Out::Closed {
        err = None;
    }
    let (out, err) = (drain(out), drain(err));
    let deadline = Instant::now() + HANG;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("hung: still running after {}s", HANG.as_secs()));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("wait: {e}")),
        }
    };
    let text = |h: Option<std::thread::JoinHandle<String>>| {
        h.and_then(|h| h.join().ok()).unwrap_or_default()
    };
    let (out, err) = (text(out), text(err));
    let all = format!("{out}{err}");
    let Some(code) = status.code() else {
        return Err(format!("killed by a signal ({status:?}): {err}"));
    };
    if code == 101 || all.contains("panicked") {
        return Err(format!("panicked (exit {code}): {err}"));
    }
    let missing = |want: &[&str], text: &str| -> Option<String> {
        want.iter()
            .find(|w| !text.contains(**w))
            .map(|w| format!("does not name {w:?}"))
    };
    match c.expect {
        Expect::Usage(_) if code != 2 => Err(format!("exit {code}, not 2: {err}")),
        Expect::Usage(want) => missing(want, &err).map_or(Ok(code), |m| Err(format!("{m}: {err}"))),
        Expect::Success(_) if code != 0 => Err(format!("exit {code}, not 0: {err}")),
        Expect::Success(want) => {
            missing(want, &all).map_or(Ok(code), |m| Err(format!("{m}: {all}")))
        }
        Expect::Survives => Ok(code),
    }
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.display().to_string()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(
        unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
        0,
        "{}",
        p.display()
    );
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let (src, dst) = (e.path(), to.join(e.file_name()));
        if e.file_type().unwrap().is_dir() {
            copy_dir(&src, &dst);
        } else if e.file_type().unwrap().is_file() {
            fs::copy(&src, &dst).unwrap();
        }
    }
}

/// Deterministic noise.
fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A short CPU run of the tiny default on a small corpus.
fn run_args(run: &Path, steps: u32) -> Vec<OsString> {
    [
        "train",
        "--no-tui",
        "--device",
        "cpu",
        "--max-steps",
        &steps.to_string(),
        "--set",
        "data.builtin_tokens=100000",
        "--set",
        "model.n_layer=1",
        "--set",
        "model.pos=learned",
        "--set",
        "eval.batches=1",
        "--set",
        "eval.every=2",
        "--set",
        "checkpoint.every_steps=2",
        "--run-dir",
    ]
    .iter()
    .map(OsString::from)
    .chain([run.as_os_str().to_os_string()])
    .collect()
}

fn with(mut args: Vec<OsString>, more: &[&str]) -> Vec<OsString> {
    args.extend(more.iter().map(OsString::from));
    args
}

fn raw(name: &str, args: Vec<OsString>, expect: Expect) -> Case {
    Case {
        name: name.into(),
        args,
        stdout: Out::Captured,
        stderr: Out::Captured,
        expect,
    }
}

/// A files corpus in `dir` and its config; `prepared`: its token cache written.
fn corpus(dir: &Path, prepared: bool) -> (PathBuf, PathBuf) {
    let text = dir.join("text");
    fs::create_dir_all(&text).unwrap();
    fs::write(
        text.join("a.txt"),
        "a hostile corpus, line after line.\n".repeat(400),
    )
    .unwrap();
    let cfg = dir.join("files.toml");
    fs::write(
        &cfg,
        "[data]\nsource = \"files\"\ntrain = \"text\"\n[model]\nn_layer = 1\nseq_len = 32\n",
    )
    .unwrap();
    if prepared {
        let o = Command::new(env!("CARGO_BIN_EXE_cockpit"))
            .arg("prepare")
            .arg(&cfg)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let cache = fs::read_dir(text.join(".cockpit-cache"))
        .ok()
        .and_then(|mut d| d.find(|e| e.as_ref().is_ok_and(|e| e.path().is_dir())))
        .map(|e| e.unwrap().path())
        .unwrap_or_default();
    (cfg, cache)
}

#[test]
fn hostile_input_never_panics_aborts_or_hangs() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let mut cases: Vec<Case> = Vec::new();
    let file = |name: &str, body: &[u8]| -> PathBuf {
        let p = d.join(name);
        fs::write(&p, body).unwrap();
        p
    };

    // --- configs
    for (set, key) in [
        ("optim.lr=1e300", "optim.lr"),
        ("model.n_embd=0", "model.n_embd"),
        ("model.n_layer=1000000000", "model.n_layer"),
        ("data.builtin_tokens=1000000000000", "data.builtin_tokens"),
        ("optim.micro_batch=1000000000", "optim.micro_batch"),
        ("model.seq_len=-1", "model.seq_len"),
        ("model.n_embd=abc", "model.n_embd"),
        ("nosuch.key=1", "nosuch"),
        ("model.norm=batchnorm", "model.norm"),
        ("scu.lambda_max=1e300", "scu.lambda_max"),
        ("foo", "--set foo"),
    ] {
        cases.push(raw(
            &format!("--set {set}"),
            with(run_args(&d.join("never"), 2), &["--set", set]),
            Expect::Usage(&[]),
        ));
        // (the key must be named: checked below through a leaked 'static)
        let key: &'static str = Box::leak(key.to_string().into_boxed_str());
        let set_flag: &'static str = Box::leak(format!("--set {set}").into_boxed_str());
        if let Some(last) = cases.last_mut() {
            last.expect = Expect::Usage(Box::leak(Box::new([key, set_flag])));
        }
    }
    let garbage = file("garbage.toml", &noise(4096, 1));
    let unknown = file("unknown.toml", b"[model]\nfoo = 1\n");
    let big = file("big.toml", &vec![b'#'; 17 << 20]);
    let fifo_cfg = d.join("fifo.toml");
    mkfifo(&fifo_cfg);
    fs::create_dir_all(d.join("dir.toml")).unwrap();
    for (name, path, want) in [
        ("config of random bytes", garbage.clone(), "garbage.toml"),
        ("config with an unknown key", unknown, "foo"),
        ("config of 17 MiB", big, "big.toml"),
        ("config that is a FIFO", fifo_cfg, "regular file"),
        ("config that is a directory", d.join("dir.toml"), "dir.toml"),
        (
            "config that is missing",
            d.join("missing.toml"),
            "missing.toml",
        ),
        (
            "config that is /dev/zero",
            PathBuf::from("/dev/zero"),
            "/dev/zero",
        ),
    ] {
        let want: &'static [&'static str] = Box::leak(Box::new([want]));
        cases.push(case(
            name,
            &[&"train", &"--no-tui", &path],
            Expect::Usage(want),
        ));
        cases.push(case(
            &format!("check {name}"),
            &[&"check", &path],
            Expect::Survives,
        ));
    }

    // --- data
    let data_cfg = |name: &str, body: String| -> PathBuf {
        let p = d.join(format!("{name}.toml"));
        fs::write(&p, format!("[data]\nsource = \"files\"\n{body}\n")).unwrap();
        p
    };
    let empty = file("empty.txt", b"");
    let bad_jsonl = file("bad.jsonl", b"{\"text\": \"fine\"}\n{\"text\": 5}\n");
    let bad_tok = file("tokenizer.json", &noise(2048, 2));
    let fifo_tok = d.join("fifo-tokenizer.json");
    mkfifo(&fifo_tok);
    let fifo_train = d.join("fifo-train.txt");
    mkfifo(&fifo_train);
    let text = file("text.txt", "some text to train on. ".repeat(200).as_bytes());
    let q = |p: &Path| format!("{:?}", p.display().to_string());
    for (name, body, want) in [
        (
            "data.train missing",
            "train = \"/nonexistent/x\"".to_string(),
            "data.train",
        ),
        (
            "data.train empty",
            format!("train = {}", q(&empty)),
            "data.train",
        ),
        (
            "a JSONL record without text",
            format!("train = {}", q(&bad_jsonl)),
            "bad.jsonl:2",
        ),
        (
            "data.train a FIFO",
            format!("train = {}", q(&fifo_train)),
            "data.train",
        ),
        (
            "a tokenizer of random bytes",
            format!("train = {}\ntokenizer = {}", q(&text), q(&bad_tok)),
            "data.tokenizer",
        ),
        (
            "a tokenizer that is a FIFO",
            format!("train = {}\ntokenizer = {}", q(&text), q(&fifo_tok)),
            "data.tokenizer",
        ),
    ] {
        let want: &'static [&'static str] = Box::leak(Box::new([want]));
        let cfg = data_cfg(&name.replace(' ', "-"), body);
        cases.push(case(name, &[&"prepare", &cfg], Expect::Usage(want)));
    }
    // a FIFO among the data files is skipped, not read
    let with_fifo = d.join("with-fifo");
    let (cfg, _) = corpus(&with_fifo, false);
    mkfifo(&with_fifo.join("text/pipe.txt"));
    cases.push(case(
        "a FIFO among the data files",
        &[&"prepare", &cfg],
        Expect::Success(&[]),
    ));

    // --- token caches (each its own corpus): rebuilt from the sources, or an error naming them
    type Damage = fn(&Path);
    let caches: [(&str, Damage, Expect); 5] = [
        (
            "a cache truncated to half",
            |c| {
                let f = OpenOptions::new()
                    .write(true)
                    .open(c.join("train.bin"))
                    .unwrap();
                let n = f.metadata().unwrap().len();
                f.set_len(n / 2).unwrap();
            },
            Expect::Success(&["rebuilt"]),
        ),
        (
            "a cache of random bytes",
            |c| {
                let n = fs::metadata(c.join("train.bin")).unwrap().len() as usize;
                fs::write(c.join("train.bin"), noise(n, 3)).unwrap();
            },
            Expect::Success(&["rebuilt", "content changed"]),
        ),
        (
            "a cache manifest of random bytes",
            |c| fs::write(c.join("manifest.json"), noise(300, 4)).unwrap(),
            Expect::Success(&[]),
        ),
        (
            "a cache shard that is a FIFO",
            |c| {
                fs::remove_file(c.join("train.bin")).unwrap();
                mkfifo(&c.join("train.bin"));
            },
            Expect::Success(&["rebuilt"]),
        ),
        (
            "a cache shard that is a directory",
            |c| {
                fs::remove_file(c.join("train.bin")).unwrap();
                fs::create_dir(c.join("train.bin")).unwrap();
            },
            Expect::Usage(&["train.bin"]),
        ),
    ];
    for (i, (name, damage, expect)) in caches.into_iter().enumerate() {
        let (cfg, cache) = corpus(&d.join(format!("cache-{i}")), true);
        damage(&cache);
        cases.push(case(name, &[&"prepare", &cfg], expect));
    }
    // a damaged cache under a training run: rebuilt, then trained on
    let (cfg, cache) = corpus(&d.join("cache-train"), true);
    fs::write(cache.join("train.bin"), noise(2000, 5)).unwrap();
    cases.push(case(
        "training on a cache of random bytes",
        &[
            &"train",
            &"--no-tui",
            &"--device",
            &"cpu",
            &"--max-steps",
            &"2",
            &"--run-dir",
            &d.join("cache-run"),
            &cfg,
        ],
        Expect::Success(&["rebuilt"]),
    ));

    // --- checkpoints: one good run, copies of it damaged
    let good = d.join("good");
    let o = Command::new(env!("CARGO_BIN_EXE_cockpit"))
        .args(run_args(&good, 2))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let step = "checkpoints/step-00000002";
    let ckpts: [(&str, Damage, &'static [&'static str]); 6] = [
        (
            "a truncated model.safetensors",
            |r| {
                let f = OpenOptions::new()
                    .write(true)
                    .open(r.join("checkpoints/step-00000002/model.safetensors"))
                    .unwrap();
                f.set_len(100).unwrap();
            },
            &["model.safetensors"],
        ),
        (
            "a state.json of random bytes",
            |r| {
                fs::write(
                    r.join("checkpoints/step-00000002/state.json"),
                    noise(200, 6),
                )
                .unwrap()
            },
            &["state.json"],
        ),
        (
            "a checkpoint manifest of random bytes",
            |r| {
                fs::write(
                    r.join("checkpoints/step-00000002/manifest.json"),
                    noise(200, 7),
                )
                .unwrap()
            },
            &["manifest.json"],
        ),
        (
            "latest pointing nowhere",
            |r| fs::write(r.join("checkpoints/latest"), "step-99999999\n").unwrap(),
            &["latest"],
        ),
        (
            "latest that is a FIFO",
            |r| {
                fs::remove_file(r.join("checkpoints/latest")).unwrap();
                mkfifo(&r.join("checkpoints/latest"));
            },
            &["latest", "regular file"],
        ),
        (
            "model.safetensors that is a FIFO",
            |r| {
                let p = r.join("checkpoints/step-00000002/model.safetensors");
                fs::remove_file(&p).unwrap();
                mkfifo(&p);
            },
            &["model.safetensors"],
        ),
    ];
    for (i, (name, damage, want)) in ckpts.into_iter().enumerate() {
        let r = d.join(format!("ckpt-{i}"));
        copy_dir(&good, &r);
        damage(&r);
        cases.push(raw(
            &format!("resume from {name}"),
            with(run_args(&r, 4), &["--resume", "latest"]),
            Expect::Usage(want),
        ));
        cases.push(case(
            &format!("export of {name}"),
            &[&"export", &r, &d.join(format!("export-{i}"))],
            Expect::Usage(want),
        ));
        cases.push(case(
            &format!("generate from {name}"),
            &[
                &"generate",
                &r,
                &"--prompt-ids",
                &"1,2",
                &"--max-tokens",
                &"2",
            ],
            Expect::Usage(want),
        ));
    }
    // weights without optimizer state are enough to export and generate
    let no_optim = d.join("no-optim");
    copy_dir(&good, &no_optim);
    fs::remove_file(no_optim.join(step).join("optim.safetensors")).unwrap();
    cases.push(case(
        "export without optimizer state",
        &[&"export", &no_optim, &d.join("export-no-optim")],
        Expect::Success(&[]),
    ));
    cases.push(case(
        "generate without optimizer state",
        &[
            &"generate",
            &no_optim,
            &"--prompt-ids",
            &"1,2",
            &"--max-tokens",
            &"2",
        ],
        Expect::Success(&[]),
    ));
    // records that are not records
    let fifo_metrics = d.join("fifo-metrics");
    copy_dir(&good, &fifo_metrics);
    fs::remove_file(fifo_metrics.join("metrics.jsonl")).unwrap();
    mkfifo(&fifo_metrics.join("metrics.jsonl"));
    cases.push(case(
        "plot of a FIFO metrics.jsonl",
        &[&"plot", &fifo_metrics],
        Expect::Usage(&["metrics.jsonl"]),
    ));
    let noisy = d.join("noisy-metrics");
    copy_dir(&good, &noisy);
    fs::write(noisy.join("metrics.jsonl"), noise(5000, 8)).unwrap();
    cases.push(case(
        "plot of a random metrics.jsonl",
        &[&"plot", &noisy],
        Expect::Usage(&["metrics.jsonl: line 1"]),
    ));

    // --- output that fails
    for (out, err) in [
        (Out::Full, Out::Full),
        (Out::Closed, Out::Closed),
        (Out::Closed, Out::Captured),
    ] {
        let tag = |o: Out| match o {
            Out::Full => "/dev/full",
            Out::Closed => "a closed pipe",
            Out::Captured => "a pipe",
        };
        let how = format!("stdout to {}, stderr to {}", tag(out), tag(err));
        for args in [
            vec!["check".to_string()],
            vec!["--help".to_string()],
            vec!["plot".to_string(), good.display().to_string()],
            vec![
                "generate".to_string(),
                good.display().to_string(),
                "--prompt-ids".to_string(),
                "1,2".to_string(),
                "--max-tokens".to_string(),
                "4".to_string(),
            ],
        ] {
            cases.push(
                raw(
                    &format!("{} with {how}", args[0]),
                    args.iter().map(OsString::from).collect(),
                    Expect::Survives,
                )
                .out(out, err),
            );
        }
    }
    let quiet = d.join("quiet");
    cases.push(
        raw(
            "train with both outputs on /dev/full",
            run_args(&quiet, 2),
            Expect::Success(&[]),
        )
        .out(Out::Full, Out::Full),
    );
    let closed = d.join("closed");
    cases.push(
        raw(
            "train with both outputs closed",
            run_args(&closed, 2),
            Expect::Success(&[]),
        )
        .out(Out::Closed, Out::Closed),
    );
    cases.push(
        raw(
            "a config error with stderr on /dev/full",
            with(run_args(&d.join("never"), 2), &["--set", "optim.lr=1e300"]),
            Expect::Survives,
        )
        .out(Out::Full, Out::Full),
    );

    // --- run them, two at a time
    let next = AtomicUsize::new(0);
    let failures = Mutex::new(Vec::new());
    let codes = Mutex::new(std::collections::BTreeMap::<i32, Vec<String>>::new());
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(c) = cases.get(i) else { break };
                match run(c) {
                    Ok(code) => codes
                        .lock()
                        .unwrap()
                        .entry(code)
                        .or_default()
                        .push(c.name.clone()),
                    Err(e) => failures.lock().unwrap().push(format!("{}: {e}", c.name)),
                }
            });
        }
    });
    let failures = failures.into_inner().unwrap();
    for (code, names) in codes.into_inner().unwrap() {
        eprintln!("exit {code}: {} cases: {}", names.len(), names.join("; "));
    }
    eprintln!(
        "{} hostile cases in {:.1}s, {} failed",
        cases.len(),
        started.elapsed().as_secs_f64(),
        failures.len()
    );
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    // the outputs that failed did not cost the runs their records
    for r in [&quiet, &closed] {
        let m = fs::read_to_string(r.join("metrics.jsonl")).unwrap_or_default();
        assert!(m.contains("\"event\":\"finished\""), "{}: {m}", r.display());
        assert!(r.join("checkpoints/latest").is_file(), "{}", r.display());
    }
    drop(File::open(&garbage));
}
