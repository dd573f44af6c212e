//! The simulator's faults, seen by a plain HTTP client: every later gateway test relies
//! on these behaving exactly as scripted.

use serde_json::{Value, json};
use spillway_sim::{Behavior, ErrorFlavor, Fault, RandomFault, Scenario, Step, start};
use std::time::{Duration, Instant};

async fn sim() -> spillway_sim::SimHandle {
    start("127.0.0.1:0".parse().unwrap(), Scenario::default())
        .await
        .unwrap()
}

fn chat(client: &reqwest::Client, base: &str, stream: bool) -> reqwest::RequestBuilder {
    client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({"model": "gpt-4o-mini", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}))
}

fn status(code: u16, error: Option<ErrorFlavor>) -> Fault {
    status_with(code, error, None, None, None)
}

fn status_with(
    code: u16,
    error: Option<ErrorFlavor>,
    retry_after_s: Option<u64>,
    retry_after_date_s: Option<u64>,
    retry_delay: Option<&str>,
) -> Fault {
    Fault::Status {
        status: code,
        error,
        retry_after_s,
        retry_after_date_s,
        retry_delay: retry_delay.map(str::to_owned),
        message: None,
    }
}

#[tokio::test]
async fn script_then_fault_then_counts() {
    let s = sim().await;
    let c = reqwest::Client::new();
    s.set_behavior(
        "a",
        Behavior {
            script: vec![
                Step {
                    fault: status_with(429, None, Some(2), None, None),
                    times: 2,
                },
                Step {
                    fault: Fault::Ok,
                    times: 1,
                },
            ],
            fault: Some(status(503, None)),
            ..Behavior::default()
        },
    );
    let base = s.channel_url("a");
    let codes: Vec<u16> = futures_seq(&c, &base, 4).await;
    assert_eq!(codes, [429, 429, 200, 503]);
    let st = s.stats("a");
    assert_eq!((st.calls, st.faults, st.in_flight), (4, 3, 0));
    assert_eq!(s.stats("b").calls, 0, "channels are independent");
}

#[tokio::test]
async fn random_faults_hit_their_share() {
    let s = sim().await;
    let c = reqwest::Client::new();
    s.set_behavior(
        "a",
        Behavior {
            random_faults: vec![RandomFault {
                fault: status(503, None),
                probability: 0.1,
            }],
            ..Behavior::default()
        },
    );
    let codes = futures_seq(&c, &s.channel_url("a"), 2000).await;
    let failed = codes.iter().filter(|c| **c == 503).count();
    assert!(codes.iter().all(|c| *c == 200 || *c == 503));
    // 10 % of 2000: 200 expected, sd ~13.4; 120..280 is six sigma either way.
    assert!((120..280).contains(&failed), "{failed}");
    assert_eq!(s.stats("a").faults as usize, failed);
}

async fn futures_seq(c: &reqwest::Client, base: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(chat(c, base, false).send().await.unwrap().status().as_u16());
    }
    out
}

#[tokio::test]
async fn provider_error_shapes_and_retry_after() {
    let s = sim().await;
    let c = reqwest::Client::new();
    s.set_behavior(
        "q",
        Behavior {
            fault: Some(status(429, Some(ErrorFlavor::Quota))),
            ..Behavior::default()
        },
    );
    let r = chat(&c, &s.channel_url("q"), false).send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "insufficient_quota");

    s.set_behavior(
        "o",
        Behavior {
            fault: Some(status(529, None)),
            ..Behavior::default()
        },
    );
    let r = c
        .post(format!("{}/v1/messages", s.channel_url("o")))
        .json(&json!({"model": "m", "max_tokens": 5, "messages": []}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 529);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["type"], "overloaded_error");

    s.set_behavior(
        "g",
        Behavior {
            fault: Some(status_with(429, None, None, Some(30), Some("30s"))),
            ..Behavior::default()
        },
    );
    let r = c
        .post(format!(
            "{}/v1beta/models/gemini-2.5-flash:generateContent",
            s.channel_url("g")
        ))
        .json(&json!({"contents": []}))
        .send()
        .await
        .unwrap();
    let ra = r.headers()["retry-after"].to_str().unwrap().to_owned();
    let ms = spillway_wire::parse_retry_after(&ra, spillway_wire::UnixMs::from_system(std::time::SystemTime::now()))
        .unwrap();
    assert!((28_000..=30_000).contains(&ms), "{ra}");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["status"], "RESOURCE_EXHAUSTED");
    assert_eq!(v["error"]["details"][1]["retryDelay"], "30s");
}

#[tokio::test]
async fn refuse_hang_cut_and_malformed() {
    let s = sim().await;
    let c = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    s.set_behavior(
        "r",
        Behavior {
            fault: Some(Fault::Refuse),
            ..Behavior::default()
        },
    );
    let e = chat(&c, &s.channel_url("r"), false).send().await.unwrap_err();
    assert!(!e.is_timeout(), "{e}");

    s.set_behavior(
        "h",
        Behavior {
            fault: Some(Fault::Hang { ms: None }),
            ..Behavior::default()
        },
    );
    let t = Instant::now();
    assert!(
        chat(&c, &s.channel_url("h"), false)
            .send()
            .await
            .unwrap_err()
            .is_timeout()
    );
    assert!(t.elapsed() >= Duration::from_millis(450));

    s.set_behavior(
        "m",
        Behavior {
            fault: Some(Fault::MalformedBody),
            ..Behavior::default()
        },
    );
    let r = chat(&c, &s.channel_url("m"), false).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(serde_json::from_slice::<Value>(&r.bytes().await.unwrap()).is_err());

    s.set_behavior(
        "c",
        Behavior {
            fault: Some(Fault::CutAfterFirstToken { after_tokens: 1 }),
            ..Behavior::default()
        },
    );
    let mut r = chat(&c, &s.channel_url("c"), true).send().await.unwrap();
    let mut got = Vec::new();
    let err = loop {
        match r.chunk().await {
            Ok(Some(b)) => got.extend_from_slice(&b),
            Ok(None) => panic!("stream ended cleanly"),
            Err(e) => break e,
        }
    };
    let text = String::from_utf8(got).unwrap();
    assert!(
        text.contains("\"content\":\"Queues\""),
        "the first token arrives before the cut: {text}"
    );
    assert!(!text.contains("[DONE]"), "{err}");
}

#[tokio::test]
async fn stream_pace_follows_tokens_per_second() {
    let s = sim().await;
    let c = reqwest::Client::new();
    s.set_behavior(
        "p",
        Behavior {
            tokens_per_second: Some(50.0),
            output_tokens: 10,
            ..Behavior::default()
        },
    );
    let t = Instant::now();
    let body = chat(&c, &s.channel_url("p"), true)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(180),
        "10 tokens at 50/s take ~200 ms"
    );
    assert!(body.ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn redirects_and_foreign_hosts() {
    let s = sim().await;
    s.set_behavior(
        "r",
        Behavior {
            fault: Some(Fault::Redirect {
                location: "http://elsewhere.example/v1/chat/completions".into(),
                status: None,
            }),
            ..Behavior::default()
        },
    );
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let r = chat(&client, &s.channel_url("r"), false).send().await.unwrap();
    assert_eq!(r.status(), 307);
    assert_eq!(r.headers()["location"], "http://elsewhere.example/v1/chat/completions");
    // P1-style: a Host that is not this machine's is refused, control API included.
    for path in ["/_control/channels", "/v1/chat/completions"] {
        let r = client
            .get(format!("{}{path}", s.url()))
            .header("host", "rebound.example")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{path}");
    }
    let r = client
        .get(format!("{}/_control/channels", s.url()))
        .header("host", format!("localhost:{}", s.addr.port()))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}
