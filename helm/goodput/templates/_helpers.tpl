{{/* Chart name, overridable. */}}
{{- define "goodput.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every object name: <release>-goodput, or the release name when it already contains it. */}}
{{- define "goodput.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "goodput.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "goodput.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: goodput
{{- end -}}

{{/* Selector labels of one component: include "goodput.selectorLabels" (list . "operator") */}}
{{- define "goodput.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "goodput.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end -}}

{{- define "goodput.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "goodput.operatorServiceAccount" -}}
{{- default (printf "%s-operator" (include "goodput.fullname" .)) .Values.serviceAccount.operatorName -}}
{{- end -}}

{{- define "goodput.autoscalerServiceAccount" -}}
{{- default (printf "%s-autoscaler" (include "goodput.fullname" .)) .Values.serviceAccount.autoscalerName -}}
{{- end -}}

{{- define "goodput.routerServiceAccount" -}}
{{- default (printf "%s-router" (include "goodput.fullname" .)) .Values.serviceAccount.routerName -}}
{{- end -}}

{{/* The router's in-cluster URL (its Service): the operator's --router-url, so status.url. */}}
{{- define "goodput.routerURL" -}}
{{- printf "http://%s.%s.svc:%v" .Values.router.service.name .Release.Namespace .Values.router.port -}}
{{- end -}}

{{/* --all-namespaces, or one --namespace per watched namespace (YAML list items). */}}
{{- define "goodput.watchArgs" -}}
{{- if .Values.watchNamespaces }}
{{- range .Values.watchNamespaces }}
- --namespace={{ . }}
{{- end }}
{{- else }}
- --all-namespaces
{{- end }}
{{- end -}}

{{/* Namespace of the dashboard ConfigMaps. */}}
{{- define "goodput.dashboardsNamespace" -}}
{{- default .Release.Namespace .Values.dashboards.namespace -}}
{{- end -}}
