//! Data-parallel plumbing that needs no GPU: the TCP rendezvous, its errors, the watchdog
//! that notices a rank going away, and the TCP collective's in-place sum.

mod common;

use cockpit::distributed::{rendezvous, RendezvousError, Topology};
use common::free_port;
use std::sync::mpsc;
use std::time::Duration;

fn topo(rank: usize, world: usize, port: u16) -> Topology {
    Topology {
        rank,
        world,
        local_rank: rank,
        master_addr: "127.0.0.1".into(),
        master_port: port,
    }
}

#[test]
fn every_rank_gets_rank_0s_payload() {
    let port = free_port();
    let world = 4;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                let payload = (r == 0).then(|| vec![7u8; 128]);
                let (p, peers) =
                    rendezvous(&topo(r, world, port), payload, Duration::from_secs(20)).unwrap();
                (p, peers.connected())
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        let (p, connected) = h.join().unwrap();
        assert_eq!(p, vec![7u8; 128], "rank {r}");
        if r == 0 {
            assert_eq!(connected, vec![1, 2, 3]);
        } else {
            assert_eq!(connected, vec![0]);
        }
    }
}

#[test]
fn a_world_size_mismatch_is_refused_naming_the_rank() {
    let port = free_port();
    let r0 = std::thread::spawn(move || {
        rendezvous(&topo(0, 2, port), Some(vec![1]), Duration::from_secs(20)).map(|_| ())
    });
    let r1 = rendezvous(&topo(1, 3, port), None, Duration::from_secs(20));
    let e0 = r0.join().unwrap().unwrap_err().to_string();
    assert!(e0.contains("rank 1") && e0.contains("WORLD_SIZE 3"), "{e0}");
    assert!(matches!(r1, Err(RendezvousError::Refused(_))));
}

#[test]
fn missing_peers_time_out_with_a_clear_message() {
    let port = free_port();
    let e = rendezvous(&topo(1, 2, port), None, Duration::from_millis(600))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("rank 1: could not reach rank 0 at 127.0.0.1:"),
        "{e}"
    );
    assert!(e.contains("MASTER_ADDR"), "{e}");
    let e = rendezvous(&topo(0, 3, port), Some(vec![]), Duration::from_millis(600))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("only 1 of 3 ranks joined") && e.contains("missing: 1, 2"),
        "{e}"
    );
}

#[test]
fn the_watchdog_names_a_rank_that_vanishes_but_not_one_that_says_goodbye() {
    for polite in [false, true] {
        let port = free_port();
        let worker = std::thread::spawn(move || {
            let (_, mut peers) =
                rendezvous(&topo(1, 2, port), None, Duration::from_secs(20)).unwrap();
            if polite {
                peers.goodbye();
            }
            drop(peers);
        });
        let (_, peers) =
            rendezvous(&topo(0, 2, port), Some(vec![]), Duration::from_secs(20)).unwrap();
        let (tx, rx) = mpsc::channel();
        peers.watch(move |m| {
            let _ = tx.send(m);
        });
        worker.join().unwrap();
        let got = rx.recv_timeout(Duration::from_secs(2));
        if polite {
            assert!(got.is_err(), "a goodbye is no alarm: {got:?}");
        } else {
            let m = got.unwrap();
            assert!(m.contains("rank 1") && m.contains("went away"), "{m}");
        }
    }
}

#[test]
fn tcp_all_reduce_sums_in_place_on_every_rank() {
    use candle_core::{Device, Tensor};
    use cockpit::distributed::{join, Backend};
    let port = free_port();
    let world = 3;
    let handles: Vec<_> = (0..world)
        .map(|r| {
            std::thread::spawn(move || {
                let joined = join(
                    topo(r, world, port),
                    Backend::Tcp,
                    "/tmp/unused",
                    None,
                    cockpit::distributed::Meet::Listen,
                    Duration::from_secs(20),
                )
                .unwrap();
                let mut c = joined.connect(&Device::Cpu).unwrap();
                // Rank r holds (r + 1)·[1, 2, 3, 4]; the sum over ranks is 6·[1, 2, 3, 4].
                let k = (r + 1) as f32;
                let t = Tensor::new(&[k, 2.0 * k, 3.0 * k, 4.0 * k], &Device::Cpu).unwrap();
                c.all_reduce_sum_in_place(&t).unwrap();
                c.finish();
                t.to_vec1::<f32>().unwrap()
            })
        })
        .collect();
    for (r, h) in handles.into_iter().enumerate() {
        assert_eq!(h.join().unwrap(), vec![6.0, 12.0, 18.0, 24.0], "rank {r}");
    }
}
